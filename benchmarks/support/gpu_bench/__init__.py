"""The rows of ``benchmarks/gpu_bench.sh``: GPU figures (speed, memory, exactness) from one prepared call."""
