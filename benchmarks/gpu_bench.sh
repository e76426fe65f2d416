#!/usr/bin/env bash
# GPU bench: the first speed and memory figures on a GPU, from one call of at most 8 minutes on one GPU (docs/gpu.md).
#
#   bash benchmarks/gpu_bench.sh [VENV]                 # needs a CUDA build of torch, timm, torchvision, >= 1 GPU
#   bash benchmarks/gpu_bench.sh VENV --wheels DIR      # a node with no package index: as gpu_check.sh (VENV made if
#                                                       # missing, DIR's wheels from benchmarks/gpu_wheels.sh)
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_bench.sh   # the same rows on CPU at sizes scaled down (said in the
#                                                       # row): checks the script, proves nothing about GPUs
#
# VENV defaults to the active venv ($VIRTUAL_ENV), else .venv. Rows (benchmarks/support/gpu_bench/rows.py; each a
# program of that package, its verdict and figures in the last "gpu_bench result:" line of its log):
#   ring blocks       ring attention's block kernels (the fused kernel returning the log-sum-exp, keys in a 4-member
#                     ring's blocks) against one fused scaled_dot_product_attention, ViT-L/16 widths (16 heads x 64),
#                     4k-16k tokens, bf16 and fp32: forward+backward time ratio (CUDA events, warm-up, median)
#   memory per rank   peak allocator bytes of a ViT-L/16 training step at 1024² and 2048² on 1, 2 and 4 ranks sharing
#                     the GPU (mpi plane, token tiles) against the planner's prediction: measured / predicted
#   engine overhead   one rank through HybridEngine against plain torch, ResNet-50 and ViT-B/16 at 1024², bf16
#   staged MPI        the mpi plane's staged path (device -> pinned pool -> MPI -> device, 2 ranks) against a pinned
#                     copy_ device -> host, 1 MB to 256 MB: bandwidths
#   bitwise rerun     a float64 training of 2 tiles + a layer rank (3 steps) run twice: identical, or the first
#                     difference
# Each row runs under its own time limit (rows.py: 60-150 s on cuda, 3x that on cpu; GPU_BENCH_ROW_TIMEOUT seconds
# for every row when set; a FAIL). With $OUT set, the table (gpu_bench.md) and the tails of the logs
# (gpu_bench_logs.txt) are written there after every row. Exit status 1 if a row failed.
set -uo pipefail
cd "$(dirname "$0")/.."

NAME=gpu_bench
# shellcheck source=support/gpu_shell.sh
source benchmarks/support/gpu_shell.sh     # arguments, setup, use_venv, probe, launch, publish, give_up
arguments "${VIRTUAL_ENV:-.venv}" "$@"
setup
# on a CPU shared by more ranks than cores, MPICH's waiting ranks yield the core (as benchmarks/run_all.sh runs them)
[ "$DEVICE" = cuda ] || ROW_ENV=(MPIR_CVAR_ENABLE_HEAVY_YIELD=1)
echo "gpu_bench: device $DEVICE, logs in $LOG"

table() {
  echo "| row | result | figures | time | log |"
  echo "|---|---|---|---:|---|"
  printf '%s\n' "${ROWS[@]}"
}
use_venv
probe

# the rows: name, ranks, time limit, module and arguments (tab-separated; shell-quoted by rows.py)
mapfile -t PLAN < <(python -m benchmarks.support.gpu_bench.rows --device "$DEVICE" \
  ${GPU_BENCH_ROW_TIMEOUT:+--row-timeout "$GPU_BENCH_ROW_TIMEOUT"})
[ "${#PLAN[@]}" -gt 0 ] || give_up "no rows planned (benchmarks/support/gpu_bench/rows.py failed)"
for line in "${PLAN[@]}"; do
  IFS=$'\t' read -r name n ROW_TIMEOUT command <<<"$line"
  eval "args=($command)"
  echo "gpu_bench: $name ($n ranks, at most ${ROW_TIMEOUT}s)"
  launch "$name" "$n" python "${args[@]}"
  ROWS+=("$(python -m benchmarks.support.gpu_bench.table "$name" "$OUTFILE" "$RC" "$SECS" "$ROW_TIMEOUT")")
  publish
done

finish
