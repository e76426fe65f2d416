"""Tests of mpi4dl_nb.comm."""
