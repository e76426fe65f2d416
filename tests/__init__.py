"""The test suite: one folder per subpackage of mpi4dl_nb, shared helpers in tests.support."""
