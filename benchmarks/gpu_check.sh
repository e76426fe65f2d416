#!/usr/bin/env bash
# GPU check: run the CUDA paths for real on a machine with GPUs, then print one table.
#
#   bash benchmarks/gpu_check.sh [venv]        # needs a CUDA build of torch and >= 1 GPU
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh   # the same rows on CPU (gloo for nccl):
#                                                       # checks the script itself, proves nothing about GPUs
#
# Every rank uses cuda:<local rank % GPUs>. NCCL refuses two ranks on one GPU: with fewer GPUs than
# a row's ranks, its nccl rows are marked SKIP ("needs one GPU per rank") and the mpi plane's rows run
# with ranks sharing GPUs; with one GPU per rank everything runs (the rows and this choice:
# benchmarks/support/gpu_rows.py).
# Rows: the device and MPI facts, then spatial exactness (2x2 tiles, float64), engine exactness
# (5 ranks SP+LP/PP/GEMS, float64), both data planes (exchanges, channels, collectives on CUDA
# tensors; mpi plane CUDA-aware or staged through the pinned pool), each on the mpi and nccl
# planes, the p2p benchmark (mpi vs nccl) and the train CLI (5 ranks, nccl and mpi, float64:
# equal losses, peak memory per rank from the CUDA allocator). None of this could run where the
# package was written (no GPU): see docs/gpu.md for what is unverified until this script passes.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
export PATH="$PWD/$VENV/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
LOG=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
ROWS=()
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then TORCH_PLANE=nccl; else TORCH_PLANE=gloo; fi
echo "gpu_check: device $DEVICE, planes mpi and $TORCH_PLANE, logs in $LOG"

[ "$DEVICE" != cuda ] || python - <<'EOF' || { echo "gpu_check: no usable GPU here (see above); nothing run"; exit 2; }
import sys
import torch
from mpi4dl_nb.comm.device import cuda_unavailable_reason
from mpi4dl_nb.comm.mpi_plane import cuda_aware_mpi
missing = cuda_unavailable_reason()
if missing:
    print(f"gpu_check: {missing}")
    sys.exit(1)
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.device_count()} GPU(s): {names}; CUDA-aware MPI: {cuda_aware_mpi()}")
EOF

if [ "$DEVICE" = cuda ]; then GPUS=$(python -c 'import torch; print(torch.cuda.device_count())'); else GPUS=0; fi

# row NAME NPROCS ARGS...: run an MPI test program (tests/mpi/<prog>) and count its named checks
row() {
  local name=$1 n=$2; shift 2
  local out="$LOG/$(echo "$name" | tr ' /' '__').log" start=$SECONDS
  mpiexec -n "$n" python -m mpi4py -m "$@" >"$out" 2>&1 </dev/null
  local rc=$? secs=$((SECONDS - start))
  local pass fail
  pass=$(grep -c '"passed": true' "$out")
  fail=$(grep -c '"passed": false' "$out")
  local verdict=PASS
  if [ "$rc" -ne 0 ] || [ "$fail" -ne 0 ] || [ "$pass" -eq 0 ]; then verdict=FAIL; fi
  ROWS+=("| $name | $verdict | $pass passed, $fail failed (all ranks) | ${secs}s | $out |")
}

# cmd NAME NPROCS COMMAND...: run a command under mpiexec, keep its last line as the detail
cmd() {
  local name=$1 n=$2; shift 2
  local out="$LOG/$(echo "$name" | tr ' /' '__').log" start=$SECONDS
  mpiexec -n "$n" "$@" >"$out" 2>&1 </dev/null
  local rc=$? secs=$((SECONDS - start))
  local verdict=PASS
  [ "$rc" -ne 0 ] && verdict=FAIL
  ROWS+=("| $name | $verdict | exit $rc | ${secs}s | $out |")
}

# compare: the two CLI runs give the same float64 losses, memory from the CUDA allocator on GPU
compare() {
python - "$LOG" "$DEVICE" <<'EOF' && ROWS+=("$(cat "$LOG/train_compare.row")")
import json, pathlib, sys
log = pathlib.Path(sys.argv[1])
def record(name):
    for line in (log / name).read_text().splitlines()[::-1]:
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

# the rows and which run here (kind, name, ranks, skip reason or -, arguments; tab-separated)
mapfile -t PLAN < <(python -m benchmarks.support.gpu_rows --device "$DEVICE" --gpus "$GPUS")
[ "${#PLAN[@]}" -gt 0 ] || { echo "gpu_check: no rows planned (benchmarks/support/gpu_rows.py failed)"; exit 2; }
for line in "${PLAN[@]}"; do
  IFS=$'\t' read -r kind name n reason command <<<"$line"
  if [ "$reason" != - ]; then
    ROWS+=("| $name | SKIP | $reason | | |")
    continue
  fi
  eval "args=($command)"     # shell-quoted by gpu_rows.py (shlex.join)
  case $kind in
    checks) row "$name" "$n" "${args[@]}" ;;
    command) cmd "$name" "$n" "${args[@]}" ;;
    train-compare) compare ;;
  esac
done

echo
echo "| check | result | detail | time | log |"
echo "|---|---|---|---:|---|"
printf '%s\n' "${ROWS[@]}"
echo
grep -h -e '^|' -e '^device' "$LOG/p2p_benchmark.log" 2>/dev/null
if printf '%s\n' "${ROWS[@]}" | grep -q "| FAIL |"; then exit 1; fi
