#!/usr/bin/env bash
# GPU check: run the CUDA paths for real on a machine with GPUs, then print one table.
#
#   bash benchmarks/gpu_check.sh [venv]        # needs a CUDA build of torch and >= 1 GPU
#   bash benchmarks/gpu_check.sh VENV --wheels DIR      # a node with no package index (docs/gpu.md): VENV is made
#                                                       # if missing from the python3 first on PATH, its packages
#                                                       # (torch) kept visible; DIR's wheels (benchmarks/gpu_wheels.sh:
#                                                       # mpich, the project) installed with no index
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh   # the same rows on CPU (gloo for nccl):
#                                                       # checks the script itself, proves nothing about GPUs
#
# Every rank uses cuda:<local rank % GPUs>. NCCL refuses two ranks on one GPU: with fewer GPUs than
# a row's ranks, its nccl rows are marked SKIP ("needs one GPU per rank") and the mpi plane's rows run
# with ranks sharing GPUs; with one GPU per rank everything runs (the rows and this choice:
# benchmarks/support/gpu_rows.py).
# Rows: the install (with --wheels), the device, versions and MPI launch, then spatial exactness (2x2
# tiles, float64), engine exactness (5 ranks SP+LP/PP/GEMS, float64), both data planes (exchanges,
# channels, collectives on CUDA tensors; mpi plane CUDA-aware or staged through the pinned pool), each
# on the mpi and nccl planes, the p2p benchmark (mpi vs nccl) and the train CLI (5 ranks, nccl and mpi,
# float64: equal losses, peak memory per rank from the CUDA allocator). Each row is stopped after
# GPU_CHECK_ROW_TIMEOUT seconds (default 240 on cuda, 900 on cpu; a FAIL). With $OUT set, the table
# (gpu_check.md) and the tails of the logs (gpu_check_logs.txt) are written there after every row. None of
# this could run where the package was written (no GPU): see docs/gpu.md for what is unverified until this
# script passes.
set -uo pipefail
cd "$(dirname "$0")/.."

NAME=gpu_check
# shellcheck source=support/gpu_shell.sh
source benchmarks/support/gpu_shell.sh     # arguments, setup, use_venv, probe, launch, publish, give_up
arguments .venv "$@"
setup
# a row's time limit: the node's command runs 10 minutes at most; on CPU (a shared machine of 2 cores) rows run longer
if [ "$DEVICE" = cuda ]; then TORCH_PLANE=nccl ROW_LIMIT=240; else TORCH_PLANE=gloo ROW_LIMIT=900; fi
ROW_TIMEOUT=${GPU_CHECK_ROW_TIMEOUT:-$ROW_LIMIT}
echo "gpu_check: device $DEVICE, planes mpi and $TORCH_PLANE, logs in $LOG"

# table: the rows so far, then the p2p benchmark's own table
table() {
  echo "| check | result | detail | time | log |"
  echo "|---|---|---|---:|---|"
  printf '%s\n' "${ROWS[@]}"
  echo
  grep -h -e '^|' -e '^device' "$LOG/p2p_benchmark.log" 2>/dev/null
}
use_venv
probe

if [ "$DEVICE" = cuda ]; then GPUS=$(python -c 'import torch; print(torch.cuda.device_count())'); else GPUS=0; fi

# row NAME NPROCS ARGS...: run an MPI test program (tests/mpi/<prog>) and count its named checks
row() {
  local name=$1 n=$2; shift 2
  launch "$name" "$n" python -m mpi4py -m "$@"
  local pass fail verdict=PASS detail
  pass=$(grep -c '"passed": true' "$OUTFILE")
  fail=$(grep -c '"passed": false' "$OUTFILE")
  detail="$pass passed, $fail failed (all ranks)"
  if [ "$RC" -ne 0 ] || [ "$fail" -ne 0 ] || [ "$pass" -eq 0 ]; then verdict=FAIL; fi
  if [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then detail="$detail; stopped after ${ROW_TIMEOUT}s"; fi
  ROWS+=("| $name | $verdict | $detail | ${SECS}s | $OUTFILE |")
}

# cmd NAME NPROCS COMMAND...: run a command under mpiexec, judged by its exit status
cmd() {
  local name=$1 n=$2; shift 2
  launch "$name" "$n" "$@"
  local verdict=PASS detail="exit $RC"
  [ "$RC" -ne 0 ] && verdict=FAIL
  if [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then detail="stopped after ${ROW_TIMEOUT}s"; fi
  ROWS+=("| $name | $verdict | $detail | ${SECS}s | $OUTFILE |")
}

# compare: the two CLI runs give the same float64 losses, memory from the CUDA allocator on GPU
compare() {
python - "$LOG" "$DEVICE" <<'EOF' && ROWS+=("$(cat "$LOG/train_compare.row")")
import json, pathlib, sys
log = pathlib.Path(sys.argv[1])
def record(name):
    path = log / name
    for line in (path.read_text().splitlines() if path.exists() else [])[::-1]:
        start = line.find('{"model"')
        if start >= 0:
            return json.loads(line[start:])
    return None
plane, mpi = record("train_CLI_5_ranks_(torch_plane).log"), record("train_CLI_5_ranks_(mpi).log")
source = "cuda-allocator" if sys.argv[2] == "cuda" else "counted"
if plane is None or mpi is None:
    row = "| train CLI: torch-plane loss == mpi loss | FAIL | a run printed no summary | | |"
else:
    worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(plane["losses"], mpi["losses"]))
    verdict = "PASS" if worst <= 1e-9 and plane["memory_source"] == source else "FAIL"
    peaks = ", ".join(f"{p / 2**20:.1f}" for p in plane["peak_memory_bytes"])
    row = (f"| train CLI: torch-plane loss == mpi loss | {verdict} | rel diff {worst:.1e}; peak MiB "
           f"per rank {peaks} ({plane['memory_source']}); {plane['images_per_s']:.2f} vs "
           f"{mpi['images_per_s']:.2f} img/s | | |")
(log / "train_compare.row").write_text(row)
EOF
}

# the rows and which run here (kind, name, ranks, skip reason or -, variables or -, arguments; tab-separated)
mapfile -t PLAN < <(python -m benchmarks.support.gpu_rows --device "$DEVICE" --gpus "$GPUS")
[ "${#PLAN[@]}" -gt 0 ] || give_up "no rows planned (benchmarks/support/gpu_rows.py failed)"
for line in "${PLAN[@]}"; do
  IFS=$'\t' read -r kind name n reason environment command <<<"$line"
  if [ "$reason" != - ]; then
    ROWS+=("| $name | SKIP | $reason | | |")
    continue
  fi
  eval "args=($command)"     # shell-quoted by gpu_rows.py (shlex.join)
  ROW_ENV=()
  [ "$environment" = - ] || eval "ROW_ENV=($environment)"
  echo "gpu_check: $name ($n ranks)"
  case $kind in
    checks) row "$name" "$n" "${args[@]}" ;;
    command) cmd "$name" "$n" "${args[@]}" ;;
    train-compare) compare ;;
  esac
  publish
done

finish
