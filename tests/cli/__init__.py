"""Tests of mpi4dl_nb.cli: the python -m mpi4dl_nb commands."""
