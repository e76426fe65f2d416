#!/usr/bin/env bash
# Run every benchmark behind BENCHMARKS.md, one after another, on a quiet machine.
# Usage: bash benchmarks/run_all.sh [venv]   (prints each command, then its output)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
export PATH="$PWD/$VENV/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000
run() { echo; echo "\$ $*"; "$@"; }
# MPICH busy-polls: yield only when ranks outnumber cores (it costs latency otherwise)
yielding() { MPIR_CVAR_ENABLE_HEAVY_YIELD=1 "$@"; }
run mpiexec -n 2 python benchmarks/bench_p2p.py --repeats 50
run mpiexec -n 2 python benchmarks/bench_halo.py --size 2048
run mpiexec -n 2 python benchmarks/bench_spatial.py speed --size 2048 --steps 3 --rounds 3
run mpiexec -n 2 python benchmarks/bench_spatial.py speed --size 2048 --steps 3 --rounds 3 --slice-method horizontal
run yielding mpiexec -n 4 python benchmarks/bench_spatial.py memory --size 2048
run mpiexec -n 2 python benchmarks/bench_pipeline.py --image-size 128 --batch 8 --steps 6 --schedule gpipe
run yielding mpiexec -n 4 python benchmarks/bench_memory.py --model amoebanet --num-layers 18 --num-filters 416 --split-size 4
run python benchmarks/bench_models.py --image-size 512 --batch-size 2 --steps 5
run mpiexec -n 2 python benchmarks/bench_correctness.py guard --size 256 --steps 3 --rounds 3
run yielding mpiexec -n 4 python benchmarks/bench_correctness.py models --size 256 --steps 2 --rounds 2
run python benchmarks/bench_planner.py --markdown
run python benchmarks/bench_suggest.py --repeats 2 --markdown
run mpiexec -n 5 python benchmarks/bench_layer_timing.py --repeats 5
run yielding mpiexec -n 5 python benchmarks/bench_meetings.py
run python benchmarks/bench_tune_order.py
run python benchmarks/bench_infer.py --size 2048 --window 256 --ranks 1 2 4 --big 20000
run python benchmarks/bench_soak.py --steps 3000 --sample-every 100
run yielding mpiexec -n 4 python benchmarks/bench_ooc.py --width 4 --budget-mib 8 --probe 128 --time-size 384 --steps 5
