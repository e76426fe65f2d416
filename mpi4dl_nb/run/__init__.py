"""Batch jobs: the ``python -m mpi4dl_nb`` commands, the training loop, checkpoints and metrics."""
