# The shell benchmarks/gpu_check.sh and benchmarks/gpu_bench.sh share, sourced by them: the arguments ([VENV] [--wheels
# DIR]), the venv and the wheels (--wheels), the device/versions/MPI probe, launching a row under mpiexec with a time
# limit, and publishing the table and the logs' tails into $OUT. The caller sets NAME (its name: gpu_check, gpu_bench)
# before sourcing, defines table() (the table so far) and sets ROW_TIMEOUT and ROW_ENV (variables for every rank)
# before launching rows.

usage() { echo "usage: bash benchmarks/$NAME.sh [VENV] [--wheels DIR]   (VENV default $DEFAULT_VENV)"; exit 2; }

# arguments DEFAULT_VENV "$@": sets VENV and WHEELS (exit 2 on a bad argument or a DIR without wheels)
arguments() {
  DEFAULT_VENV=$1; shift
  VENV=$DEFAULT_VENV WHEELS=
  while [ $# -gt 0 ]; do
    case $1 in
      --wheels) [ $# -ge 2 ] || usage; WHEELS=$2; shift 2 ;;
      --wheels=*) WHEELS=${1#--wheels=}; shift ;;
      -*) echo "$NAME: unknown option $1"; usage ;;
      *) VENV=$1; shift ;;
    esac
  done
  if [ -n "$WHEELS" ] && ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "$NAME: --wheels $WHEELS holds no *.whl: make them with bash benchmarks/gpu_wheels.sh $WHEELS"; exit 2
  fi
}

# setup: the working tree on PYTHONPATH, one thread per rank, a log folder (LOG), no rows yet, the device (DEVICE)
setup() {
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  LOG=$(mktemp -d "${TMPDIR:-/tmp}/$NAME.XXXXXX")
  ROWS=()
  ROW_ENV=()
  DEVICE=${GPU_CHECK_DEVICE:-cuda}
}

# publish: the table and the logs' tails into $OUT when set
publish() {
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  table >"$OUT/$NAME.md"
  for f in "$LOG"/*.log; do
    [ -e "$f" ] && { echo "==> $(basename "$f") <=="; tail -n 40 "$f"; echo; }
  done >"$OUT/${NAME}_logs.txt"
}
give_up() { echo "$NAME: $1"; publish; exit 2; }

# install: VENV made if missing from the python3 first on PATH with its packages visible (a venv made from inside a
# venv sees only the base interpreter's: benchmarks/support/node_venv.py), then DIR's wheels with no index
install() {
  local start=$SECONDS made=no
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m benchmarks.support.node_venv "$VENV" || return 1
    made=yes
  fi
  "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip -q || return 1
  "$VENV/bin/python" -m pip install --no-index --no-deps --force-reinstall --no-cache-dir --find-links "$WHEELS" \
    "$WHEELS"/*.whl || return 1
  local names
  names=$(cd "$WHEELS" && ls -1 ./*.whl | sed 's|^\./||; s/-[0-9].*//' | tr '\n' ' ')
  ROWS+=("| install (--wheels $WHEELS) | PASS | venv $VENV (made: $made); $names| $((SECONDS - start))s | $LOG/install.log |")
}

# use_venv: the wheels installed when --wheels was given, then VENV's bin/ first on PATH
use_venv() {
  if [ -n "$WHEELS" ]; then
    install >"$LOG/install.log" 2>&1 || { tail -n 20 "$LOG/install.log"; give_up "the install failed (above)"; }
    cat "$LOG/install.log"
  fi
  [ -d "$VENV" ] && VENV=$(cd "$VENV" && pwd)
  export PATH="$VENV/bin:$PATH"
}

# probe: the device, the versions and MPI, a row (FACTS: what was found): stop here (exit 2) when CUDA is asked for
# and unusable, or when mpiexec does not start a world of several ranks for mpi4py's MPI (an mpiexec of another MPI:
# every rank alone)
probe() {
  local start=$SECONDS
  FACTS=$(python - "$DEVICE" "$NAME" 2>"$LOG/device.log" <<'PYTHON'
import platform, sys
import torch
import mpi4py
from mpi4py import MPI
parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
if sys.argv[1] == "cuda":
    from mpi4dl_nb.comm.device import cuda_unavailable_reason
    from mpi4dl_nb.comm.mpi_plane import cuda_aware_mpi
    missing = cuda_unavailable_reason()
    if missing:
        sys.exit(f"{sys.argv[2]}: {missing}")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    parts += [f"CUDA {torch.version.cuda}", f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
              f"{torch.cuda.device_count()} GPU(s): {names}", f"CUDA-aware MPI: {cuda_aware_mpi()}"]
else:
    parts.append("device cpu")
parts += [f"mpi4py {mpi4py.__version__}", " ".join(MPI.Get_library_version().splitlines()[0].split())[:60]]
print("; ".join(parts))
PYTHON
) || { cat "$LOG/device.log"; give_up "no usable GPU or MPI here (see above); nothing run"; }
  timeout -k 5 60 mpiexec -n 2 python -c 'import sys; from mpi4py import MPI; sys.exit(MPI.COMM_WORLD.Get_size() != 2)' \
    >>"$LOG/device.log" 2>&1 </dev/null \
    || { cat "$LOG/device.log"; give_up "$(command -v mpiexec || echo 'no mpiexec') does not start 2 ranks for \
mpi4py's MPI ($FACTS): give --wheels DIR holding the mpich wheel (benchmarks/gpu_wheels.sh)"; }
  ROWS+=("| device, versions, MPI | PASS | $FACTS; mpiexec $(command -v mpiexec) starts 2 ranks | $((SECONDS - start))s \
| $LOG/device.log |")
  echo "$NAME: $FACTS"
  publish
}

# launch NAME NPROCS COMMAND...: run under mpiexec with the row's variables (ROW_ENV) and time limit (ROW_TIMEOUT);
# sets OUTFILE, RC and SECS
launch() {
  local name=$1 n=$2; shift 2
  OUTFILE="$LOG/$(echo "$name" | tr ' /' '__').log"
  local start=$SECONDS
  env "${ROW_ENV[@]}" timeout -k 10 "$ROW_TIMEOUT" mpiexec -n "$n" "$@" >"$OUTFILE" 2>&1 </dev/null
  RC=$? SECS=$((SECONDS - start))
}

# finish: the whole table printed and published; exit 1 if a row failed (a skipped row is not a failure)
finish() {
  echo
  table
  publish
  if printf '%s\n' "${ROWS[@]}" | grep -q "| FAIL |"; then exit 1; fi
}
