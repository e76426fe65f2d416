#!/usr/bin/env bash
# Run every benchmark command that BENCHMARKS.md shows, one after another (tests/test_benchmarks_doc.py checks
# that each of its commands is here).
# Usage: bash benchmarks/run_all.sh [venv]
#   BENCH_ONLY=REGEX   run only the commands matching REGEX (grep -E), e.g. BENCH_ONLY='soak|ooc'
#   BENCH_SKIP=REGEX   leave out the commands matching REGEX
#   BENCH_LOGS=DIR     also write each command's output to DIR/NN-<script>.log
# A failing command is reported and the others still run; the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
export PATH="$PWD/$VENV/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000
FAILED=()
COUNT=0
run() {
  COUNT=$((COUNT + 1))
  if [ -n "${BENCH_ONLY:-}" ] && ! grep -qE -e "$BENCH_ONLY" <<<"$*"; then return; fi
  if [ -n "${BENCH_SKIP:-}" ] && grep -qE -e "$BENCH_SKIP" <<<"$*"; then return; fi
  local log=/dev/null
  if [ -n "${BENCH_LOGS:-}" ]; then
    mkdir -p "$BENCH_LOGS"
    log="$BENCH_LOGS/$(printf %02d "$COUNT")-$(grep -oE 'bench_[a-z0-9_]+' <<<"$*" | head -1).log"
  fi
  echo; echo "\$ $*" | tee "$log"
  "$@" 2>&1 | tee -a "$log" || FAILED+=("$*")
}
# MPICH busy-polls: yield only when ranks outnumber cores (it costs latency otherwise)
yielding() { MPIR_CVAR_ENABLE_HEAVY_YIELD=1 "$@"; }

# 1. point-to-point and halos
run mpiexec -n 2 python benchmarks/bench_p2p.py --repeats 50
run mpiexec -n 2 python benchmarks/bench_halo.py --size 2048
# 2. spatial speed and memory; overlap and regions
run mpiexec -n 2 python benchmarks/bench_spatial.py speed --size 2048 --steps 3 --rounds 3
run yielding mpiexec -n 4 python benchmarks/bench_spatial.py memory --size 2048
run mpiexec -n 2 python benchmarks/bench_overlap.py --size 2048 --backend mpi
run mpiexec -n 2 python benchmarks/bench_overlap.py --size 2048 --backend gloo
# across test hosts (root: network namespaces)
run python benchmarks/bench_hosts.py --rates unlimited,10gbit,1gbit
# 3. pipeline and GEMS (with torch.distributed.pipelining beside them)
run mpiexec -n 2 python benchmarks/bench_pipeline.py --image-size 128 --batch 8 --steps 6 --schedule gpipe
run mpiexec -n 2 python benchmarks/bench_pipeline.py --image-size 128 --batch 8 --steps 6 --schedule 1f1b
run mpiexec -n 2 python benchmarks/bench_pipeline.py --new-schedules
run yielding mpiexec -n 4 python benchmarks/bench_pipeline.py --new-schedules
run mpiexec -n 2 python benchmarks/bench_pipeline.py --new-schedules --image-size 128 --channels 32 --micro-batches 4
run mpiexec -n 2 python benchmarks/bench_actions.py --rounds 5
# 11. gradient all-reduce overlapped with backward (data_parallel=2, local_dp=2)
run mpiexec -n 2 python benchmarks/bench_grad_overlap.py --backend mpi --markdown
run mpiexec -n 2 python benchmarks/bench_grad_overlap.py --backend gloo --markdown
# 4. weights per rank; models as batch jobs; models nobody here wrote (torchvision)
run yielding mpiexec -n 4 python benchmarks/bench_memory.py --model amoebanet --num-layers 18 --num-filters 416 --split-size 4
run python benchmarks/bench_models.py --image-size 256 --batch-size 2 --steps 4
run yielding mpiexec -n 5 python benchmarks/bench_byom.py --size 1024 --markdown
# 5. cost of exactness
run mpiexec -n 2 python benchmarks/bench_correctness.py guard --size 256 --steps 3 --rounds 3
run yielding mpiexec -n 4 python benchmarks/bench_correctness.py models --size 256 --steps 2 --rounds 2
run yielding mpiexec -n 4 python benchmarks/bench_unet.py --size 1024 --markdown
# 6. waiting ranks
run yielding mpiexec -n 3 python benchmarks/bench_wait.py
run yielding mpiexec -n 5 python benchmarks/bench_wait.py
# 7. planner and auto-tune
run python benchmarks/bench_planner.py --grid --passes 1 --markdown
run python benchmarks/bench_planner_recompute.py
run python benchmarks/bench_planner.py --byom --image-size 256 --memory-only --passes 1 --steps 1 --markdown
run yielding mpiexec -n 5 python benchmarks/bench_meetings.py
run mpiexec -n 5 python benchmarks/bench_layer_timing.py --repeats 2
run python benchmarks/bench_suggest.py --scenarios resnet-11,resnet-20,amoebanet-3 --repeats 1 --markdown
run python benchmarks/bench_suggest.py --scenarios resnet-29,resnet-11-384,amoebanet-6 --repeats 1 --markdown
run python benchmarks/bench_tune_order.py --jobs 2
# 8. inference, soak, out of core
run python benchmarks/bench_infer.py --size 2048 --window 256 --ranks 1 2 4 --big 10000
run python benchmarks/bench_infer_dense.py --size 1024 --roi 256 --ranks 1 4
run python benchmarks/bench_infer_memory.py --side 1024 --window 256 --ranks 4 --dtype float64
run python benchmarks/bench_soak.py --steps 3000 --sample-every 100
run python benchmarks/bench_soak.py --steps 3000 --sample-every 100 --configs sp_lp --modes api --backend mpi --from-step 1000
run python benchmarks/bench_soak.py --steps 3000 --sample-every 100 --configs sp_lp --modes api --backend gloo --from-step 1000
run yielding mpiexec -n 4 python benchmarks/bench_ooc.py --width 4 --budget-mib 8 --probe 128 --time-size 384 --steps 5
# 9. whole slides: the largest canvas per rank budget (each job its own mpiexec), what resolution buys
run python benchmarks/bench_whole_slide_memory.py --budget-mib 256,448
run python benchmarks/bench_resolution.py --seeds 2 --figure docs/images/whole_slide_resolution.png
# 10. volumes: activation memory per rank on 3-D tiles, dense volume inference beside MONAI
run mpiexec -n 8 python benchmarks/bench_volume_memory.py --stack-side 128 --unet-side 96
run mpiexec -n 2 python benchmarks/bench_volume_rss.py
run python benchmarks/bench_infer_volume.py
run python benchmarks/bench_infer_volume.py --model swinunetr3d --size 32,64,64 --window 32,32,32 --ranks 1 2
# 14. vision transformers on token tiles: activation bytes per rank, ring vs all-gathered, torch's context parallel
run yielding mpiexec -n 4 python benchmarks/bench_vit.py --sizes 1024,2048 --rounds 3,1 --cp-tokens 64 --cp-timeout 400
# 15. Swin-T on 2x2 tiles at 1024 px: activation bytes per rank, bytes sent per shifted-window block
run yielding mpiexec -n 4 python benchmarks/bench_swin.py
run mpiexec -n 2 python benchmarks/bench_swin.py --grid 1x2
# 16. input read ahead of the step: the wait per step with a reader slowed on purpose
run python benchmarks/bench_read_ahead.py --markdown
# 17. transformers at full speed on tiles: one process against 1x2 tiles, ViT-S/16 (4 blocks, 768 px) and Swin-T
#     (448 px), forward + backward in alternating turns
run mpiexec -n 2 python benchmarks/bench_transformer_tiles.py
# 18. foundation-model ViTs (L/16, H/14, g/14) on token tiles: the largest rank's activation bytes measured beside the
#     planner's, and the planner's largest image per P for 16 and 80 GB per rank
run yielding mpiexec -n 4 python benchmarks/bench_foundation_memory.py --measure L:1024,L:2048,H:1024,H:2048,g:1024,g:2048
# 18. training state per rank under --zero-stage 0-3: real sharded runs beside the planner; what fits by ZeRO stage
run python benchmarks/bench_zero_memory.py --measure --fits
run python benchmarks/bench_full_step.py --models swin --stages 0,2 --runs 3 --steps 5

if [ ${#FAILED[@]} -gt 0 ]; then
  echo; echo "failed:"; printf '  %s\n' "${FAILED[@]}"; exit 1
fi
