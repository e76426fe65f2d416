"""Tests of mpi4dl_nb.checkpoint and the resume policy."""
