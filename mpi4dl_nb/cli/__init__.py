"""The ``python -m mpi4dl_nb`` commands: flags, their checks, the set-up they share, one module per command."""
