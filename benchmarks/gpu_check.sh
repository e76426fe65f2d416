#!/usr/bin/env bash
# GPU check: run the CUDA paths for real on a machine with GPUs, then print one table.
#
#   bash benchmarks/gpu_check.sh [venv]        # needs a CUDA build of torch and >= 1 GPU
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh   # the same rows on CPU (gloo for nccl):
#                                                       # checks the script itself, proves nothing about GPUs
#
# Every rank uses cuda:<local rank % GPUs> (one GPU per rank is best; fewer GPUs are shared).
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

# row NAME NPROCS ARGS...: run an MPI test program (tests/mpi/<prog>) and count its named checks
row() {
  local name=$1 n=$2; shift 2
  local out="$LOG/$(echo "$name" | tr ' /' '__').log" start=$SECONDS
  mpiexec -n "$n" python -m mpi4py -m "$@" >"$out" 2>&1
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
  mpiexec -n "$n" "$@" >"$out" 2>&1
  local rc=$? secs=$((SECONDS - start))
  local verdict=PASS
  [ "$rc" -ne 0 ] && verdict=FAIL
  ROWS+=("| $name | $verdict | exit $rc | ${secs}s | $out |")
}

SPATIAL_MODELS=resnet_classifier,avgpool3_s2_excl,maxpool3_s2_p1,bn_relu_conv
for plane in mpi "$TORCH_PLANE"; do
  row "spatial exactness 2x2 ($plane)" 4 tests.mpi.spatial_exactness 2 2 "$plane" "$SPATIAL_MODELS"
done
for plane in mpi "$TORCH_PLANE"; do
  row "engine exactness 5 ranks ($plane)" 5 tests.mpi.engine_exact "--backend=$plane" \
      sp_lp_square sp_pp sp_gems_pp
  row "engine exactness 3 ranks GEMS 1F1B ($plane)" 3 tests.mpi.engine_exact "--backend=$plane" \
      gems3_1f1b_m2 lp3
done
row "both planes, 2 ranks (mpi, $TORCH_PLANE)" 2 tests.mpi.comm_planes "--device=$DEVICE"
row "both planes, 4 ranks (mpi, $TORCH_PLANE)" 4 tests.mpi.comm_planes "--device=$DEVICE"
row "soak: trace and memory flat ($TORCH_PLANE)" 5 tests.mpi.soak sp_lp 300 "--backend=$TORCH_PLANE"

cmd "p2p benchmark" 2 python benchmarks/bench_p2p.py --device "$DEVICE" --repeats 20
TRAIN=(python -m mpi4dl_nb train --model resnet --resnet-version 1 --num-layers 8 --num-filters 8
       --image-size 64 --batch-size 4 --num-samples 8 --split-size 2 --spatial-size 1
       --num-spatial-parts 4 --parts 2 --steps 3 --dtype float64 --device "$DEVICE" --no-progress -v)
cmd "train CLI 5 ranks (torch plane)" 5 "${TRAIN[@]}" --backend "$TORCH_PLANE"
cmd "train CLI 5 ranks (mpi)" 5 "${TRAIN[@]}" --backend mpi

# the two CLI runs: same float64 losses, memory from the CUDA allocator on GPU
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

echo
echo "| check | result | detail | time | log |"
echo "|---|---|---|---:|---|"
printf '%s\n' "${ROWS[@]}"
echo
grep -h -e '^|' -e '^device' "$LOG/p2p_benchmark.log" 2>/dev/null
if printf '%s\n' "${ROWS[@]}" | grep -q "| FAIL |"; then exit 1; fi
