"""Tests of mpi4dl_nb.measure."""
