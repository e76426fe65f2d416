"""Layer, pipeline, GEMS and data parallelism: stages, schedules as data, the runtime and ``HybridEngine``."""
