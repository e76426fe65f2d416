"""MPI test programs, run on N ranks as modules: python -m mpi4py -m tests.mpi.<name> (see tests.support.mpirun)."""
