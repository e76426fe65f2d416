"""Tests of mpi4dl_nb.planner: memory and time models, suggest, live auto-tune."""
