"""The benchmark scripts behind BENCHMARKS.md (run as scripts; tests may import ``benchmarks.support``)."""
