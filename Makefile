# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON     ?= python3
VENV       ?= .venv
# Default: the pinned torch, and the torchvision and timm that go with it (the `models` extra: torchvision:/timm:
# models). Override, e.g. TORCH_SPEC="torch==2.14.1+cu126" TORCH_INDEX=https://download.pytorch.org/whl/cu126, or
# TORCH_SPEC= MODELS_SPEC= to keep what is installed.
TORCH_SPEC ?= torch==2.14.1
MODELS_SPEC ?= torchvision==0.29.1 timm==1.0.31
TORCH_INDEX ?=
EXTRAS     ?= local-mpi,slides,volumes,notebook,dev,models
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.mpi4dl-installed
export PATH := $(abspath $(VENV))/bin:$(PATH)
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test lint lab notebooks bench clean ci-deps slurm-up slurm-down readme-outputs gpu-rehearsal

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		$(if $(TORCH_SPEC),"$(TORCH_SPEC)") $(MODELS_SPEC) -e ".[$(EXTRAS)]"
	$(PY) -m ipykernel install --sys-prefix --name mpi4dl-nb --display-name "Python (mpi4dl-nb)" >/dev/null
	$(PY) -c "import torch, mpi4py, ipyparallel; print('installed: torch', torch.__version__)"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m mpi4dl_nb.notebook.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) .ci/any_budget.py

# The suite as two pytest runs at once (tests/streams.py): the tests that start MPI jobs beside the others,
# which are single-process and would leave a core idle. PYTEST_ARGS go to both (e.g. PYTEST_ARGS=-x).
# mypy runs beside the tests (tests/streams.py); ruff and the Any budget take under a second, first.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) .ci/any_budget.py
	$(PY) -m tests.streams $(PYTEST_ARGS)

# notebooks/.lab/labconfig turns Lab's autosave off, so a run never writes outputs into the tracked notebooks.
# As root, Jupyter refuses to start without --allow-root: added then.
lab: $(STAMP)
	JUPYTER_CONFIG_PATH="$(CURDIR)/notebooks/.lab$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS) \
		--MappingKernelManager.default_kernel_name=mpi4dl-nb

# Write notebooks/NN_name.ipynb from their jupytext sources NN_name.py (deterministic; see docs/notebooks.md).
notebooks: $(STAMP)
	$(PY) -m mpi4dl_nb.notebook.tutorials notebooks

bench: $(STAMP)
	bash benchmarks/run_all.sh

# The sample outputs of README.md and docs/*.md, run and written between their markers (docs/readme_outputs.py;
# the demo takes minutes). SAMPLES="layout train" writes some of them.
readme-outputs: $(STAMP)
	$(PY) docs/readme_outputs.py $(SAMPLES)

# System packages of the browser (tests/ui), Slurm (tests/slurm) and multihost (tests/multihost) tests: chromium,
# fontconfig, slurm-wlm, munge, iproute2 (apt).
ci-deps:
	bash .ci/deps

# The GPU node's check rehearsed here, on CPU (docs/gpu.md; not part of `make test`): a stand-in for the node's image
# (GPU_STANDIN: torch 2.11.0 and the packages the image brings, from the registry: the CUDA build, several GB), the
# node's wheels for the stand-in's python (benchmarks/gpu_wheels.sh), then the check in a venv it makes from the
# stand-in's python3 with those wheels and no index.
GPU_STANDIN ?= .venv-gpu211
GPU_STANDIN_SPEC ?= torch==2.11.0 torchvision==0.26.0 timm mpi4py numpy scipy scikit-image tifffile matplotlib
REHEARSAL ?= .gpu-rehearsal
gpu-rehearsal:
	@test -x $(GPU_STANDIN)/bin/python || $(PYTHON) -m venv $(GPU_STANDIN)
	$(GPU_STANDIN)/bin/python -m pip install -q $(GPU_STANDIN_SPEC)
	bash benchmarks/gpu_wheels.sh $(REHEARSAL)/wheels \
		$$($(GPU_STANDIN)/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	rm -rf $(REHEARSAL)/venv
	PATH="$(abspath $(GPU_STANDIN))/bin:$$PATH" GPU_CHECK_DEVICE=cpu \
		bash benchmarks/gpu_check.sh $(REHEARSAL)/venv --wheels $(REHEARSAL)/wheels

# A one-node Slurm on this machine for trying the Slurm path (root; see engines/slurm/local_cluster.sh).
slurm-up:
	bash engines/slurm/local_cluster.sh start
slurm-down:
	bash engines/slurm/local_cluster.sh stop

clean:
	rm -rf out .pytest_cache
