"""Shared test helpers: the MPI launcher and named checks, exactness checks, small models, slides."""
