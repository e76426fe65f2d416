"""Spatial parallelism: tile geometry, the adjoint halo exchange, spatial layers and ``spatialize``."""
