#!/usr/bin/env bash
# Wheels for a GPU node with no package index: what the project and benchmarks/gpu_check.sh need that the node's
# image lacks, downloaded here into DIR, to travel beside the working tree (then: gpu_check.sh VENV --wheels DIR).
#
#   bash benchmarks/gpu_wheels.sh DIR [PYTHON_VERSION]     # PYTHON_VERSION: the node's python3 (default 3.12)
#
# The image brings torch, torchvision, timm, mpi4py, numpy, scipy, scikit-image, tifffile and matplotlib. What the
# check imports beyond them (`import mpi4dl_nb`, tests/mpi/*, benchmarks/bench_p2p.py: nothing else) needs no wheel;
# what it runs does: mpi4py's wheel from PyPI carries no MPI library, and no mpiexec comes with it. So DIR gets:
#   mpich       libmpi.so.12 (found by mpi4py in the venv's lib/) and mpiexec (the venv's bin/); python-independent
#   mpi4dl_nb   the project, built here as a wheel from the working tree (installed --no-deps: ipyparallel and
#               ipywidgets, its notebook dependencies, are imported by none of the rows)
# Every *.whl already in DIR is removed first (two versions of one package stop the install). Fails if DIR ends up
# over 48 MiB (the device tool carries 64 MiB with the tree). PYTHON names the python whose pip runs (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash benchmarks/gpu_wheels.sh DIR [PYTHON_VERSION]   (e.g. .whl 3.12)"; exit 2; }
DIR=$1
PYTHON_VERSION=${2:-3.12}
PYTHON=${PYTHON:-python3}
LIMIT_MIB=48
# pip matches manylinux_2_N exactly: the tags a wheel built for an older glibc may carry
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux2010_x86_64 manylinux1_x86_64)
WHEELS=(mpich==5.0.2)

[[ $PYTHON_VERSION =~ ^3\.[0-9]+$ ]] || { echo "gpu_wheels: PYTHON_VERSION '$PYTHON_VERSION' is not like 3.12"; exit 2; }
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  "${PLATFORMS[@]/#/--platform=}" -d "$DIR" "${WHEELS[@]}"

# the project from a copy of the tree, so the build leaves no build/ or egg-info behind in the checkout
SRC=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")
trap 'rm -rf "$SRC"' EXIT
cp -r pyproject.toml README.md mpi4dl_nb "$SRC"
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
"$PYTHON" -m pip wheel -q --no-deps -w "$DIR" "$SRC"

ls -1 "$DIR"/*.whl
SIZE=$(du -sm "$DIR" | cut -f1)
if [ "$SIZE" -gt "$LIMIT_MIB" ]; then
  echo "gpu_wheels: $DIR is $SIZE MiB, over $LIMIT_MIB MiB: the device tool carries 64 MiB with the tree"
  exit 1
fi
echo "gpu_wheels: $DIR holds $SIZE MiB of wheels for python $PYTHON_VERSION (at most $LIMIT_MIB)"
