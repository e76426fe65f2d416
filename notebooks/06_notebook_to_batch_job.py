# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 06 — From notebook to batch job, and bringing your own model and slides
#
# **What you will learn**: how the configuration you explored in notebooks 01-04 runs as a batch job under
# `mpiexec` and Slurm (same engine code, MPI4DL's flag names); how to bring your own layer list, your own
# slides, your GPUs; what runs where when the notebook drives a cluster (calls, data, per-rank output,
# timeouts and a restart).
#
# **What you need**: notebooks 01 (rank layout) and 04 (training); about a minute on a laptop. No GPU,
# no Slurm: the Slurm parts print scripts you can submit as they are on a cluster.
#
# Every cell that runs a command shows the command exactly as run, its output *and* its error stream,
# and checks its return code.

# %%
import torch

import mpi4dl_nb as dl

torch.set_num_threads(1)

# %%
import os
import shlex
import subprocess
import sys
from pathlib import Path

bin_dir = Path(sys.executable).parent
env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **dl.cluster.ENGINE_ENV)


def run(command, timeout=300):
    """Run ``command``, print it as run, its stdout and stderr; fail the cell on a non-zero return code."""
    print("$", " ".join(shlex.quote(str(part)) for part in command))
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, env=env,
                            timeout=timeout)
    print(result.stdout[-3000:], end="")
    if result.stderr.strip():
        print("--- stderr ---")
        print(result.stderr[-3000:], end="")
    print(f"--- return code {result.returncode} ---")
    assert result.returncode == 0, f"the command failed with return code {result.returncode}"
    return result


# %% [markdown]
# ## The layout first: how many ranks, which does what
#
# `layout` takes only the parallelism flags (MPI4DL's names) and prints the rank table and the world size
# the job must be launched with. Run it before every batch job: a wrong `-n` is refused at start-up, but
# this costs nothing.

# %%
parallel = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2", "--slice-method", "vertical"]
layout = run([sys.executable, "-m", "mpi4dl_nb", "layout", *parallel])
world_size = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical").world_size
print("world size:", world_size)

# %% [markdown]
# **Exercise.** **Predict**: how many ranks does a job with 3 stages, the first spatial on 4 tiles,
# and 2 copies of each layer stage (`--local-DP 2`) need? Which rank holds copy 1 of stage 2? Write your
# answers in `my_world_size` and `my_rank`, run the cell, compare. (The formula is in notebook 01.)

# %%
import json

my_world_size, my_rank = 6, 5
exercise = ["--split-size", "3", "--spatial-size", "1", "--num-spatial-parts", "4", "--local-DP", "2"]
answer = json.loads(run([sys.executable, "-m", "mpi4dl_nb", "layout", *exercise, "--json"]).stdout)
holder = next(r["rank"] for r in answer["ranks"] if r["stage"] == 2 and r["copy"] == 1)
print(f"world size: you said {my_world_size}, layout says {answer['world_size']}; "
      f"copy 1 of stage 2: you said rank {my_rank}, layout says rank {holder}")
exercise_cfg = dl.ParallelConfig(split_size=3, spatial_size=1, num_spatial_parts=4, local_dp=2)
assert answer["world_size"] == exercise_cfg.world_size
print("launched with -n 6, every rank refuses before the first step:", exercise_cfg.world_size_message(6))

# %% [markdown]
# ## Your own slides: `--app medical --datapath`
#
# `--datapath` takes a folder of tiles, one slide, or a folder of slides; the first folder level below it
# names the class (here `high/` and `low/`). Slides are read with OpenSlide: every spatial rank reads only
# its own region of each tile (`read_region` on its box), and ranks that do not run the first stage read
# nothing. We write two small pyramidal TIFF "slides" cut from the bundled IHC image (a real scanner's
# `.svs`/`.ndpi`/`.mrxs` works the same) and train 2 steps on 3 ranks.

# %%
import tempfile

import numpy as np
import tifffile

from mpi4dl_nb.data.sample import ihc_image

work = Path(tempfile.mkdtemp(prefix="mpi4dl-byo-"))
pixels = ihc_image()
for name, part in (("high", pixels[:256, :256]), ("low", pixels[256:, 256:])):
    (work / "slides" / name).mkdir(parents=True)
    with tifffile.TiffWriter(work / "slides" / name / f"{name}.tif") as tw:
        level = np.ascontiguousarray(part)
        for index in range(2):
            tw.write(level, tile=(64, 64), photometric="rgb", subfiletype=1 if index else 0, metadata=None)
            level = np.ascontiguousarray(level[::2, ::2])

model = ["--model", "resnet", "--num-layers", "11", "--num-filters", "4", "--num-classes", "2",
         "--image-size", "32", "--batch-size", "2", "--steps", "2", "--no-progress"]
command = [bin_dir / "mpiexec", "-n", str(world_size), sys.executable, "-m", "mpi4dl_nb", "train", *parallel,
           *model, "--app", "medical", "--datapath", work / "slides", "--min-tissue", "0.2"]
trained = run(command)

# %% [markdown]
# The last line is the run's JSON summary (losses, images/s, world size): batch jobs parse it, as
# `engines/slurm/train.sbatch` does below to check the run against one process.
#
# ## Choosing GPUs
#
# `dl.init()` picks the device from the rank's *local* rank (its index on its node, read from the
# launcher's environment: the variables are listed below): `cuda:<local rank % GPUs per node>`, else the
# CPU. So launch one rank per GPU (`--gpus-per-task=1`, or `-n` = GPUs per node x nodes) and restrict the
# visible GPUs with `CUDA_VISIBLE_DEVICES` if you share the node. `--device cuda` (or
# `dl.init(device="cuda")`) refuses at once, naming what is missing, when no GPU can be used; `--device cpu`
# forces the CPU; `--backend` picks the tensor plane (`nccl` on GPUs, `gloo`/`mpi` on CPU; `auto` chooses).

# %%
from mpi4dl_nb.comm.device import LOCAL_RANK_VARIABLES, select_device

print("local rank read from:", ", ".join(f"{name} ({launcher})" for name, launcher in LOCAL_RANK_VARIABLES))

for local_rank in range(3):
    print(f"local rank {local_rank}: on a 2-GPU node -> {select_device(local_rank, cuda_count=2)}, "
          f"here -> {select_device(local_rank)}")

# %% [markdown]
# ## On a Slurm cluster: the batch script as it is
#
# `engines/slurm/train.sbatch` is submittable as is (`sbatch engines/slurm/train.sbatch` from the checkout with
# the environment active): it runs the configuration above on 3 tasks, then the same training in one
# process, and prints whether they are exact. Extra arguments are `train` flags; `--ntasks` must equal the
# world size that `layout` printed.

# %%
sbatch = Path(dl.__file__).resolve().parents[1] / "engines" / "slurm" / "train.sbatch"   # in the checkout
print(sbatch.read_text())

# %% [markdown]
# The notebook's cluster can run on Slurm too: `dl.cluster.start(n, launcher="slurm", slurm_options=[...])`
# submits the engines as a job (see `engines/README.md`), `launcher="hostfile"` spreads `mpiexec` over the
# hosts of a hostfile. The flags each MPI needs:

# %%
one_thread = {"OMP_NUM_THREADS": "1"}
print("mpiexec flags for MPICH:  ", dl.cluster.mpi_launch_args("mpich", one_thread, hostfile="hosts.txt"))
print("mpiexec flags for Open MPI:", dl.cluster.mpi_launch_args("openmpi", one_thread, hostfile="hosts.txt"))
print()
print(dl.cluster.slurm_batch_template(["--partition=gpu", "--time=02:00:00"], {"OMP_NUM_THREADS": "1"}))

# %% [markdown]
# ## What runs where when the notebook drives the cluster
#
# The notebook (the *kernel*) holds no model: `cluster.run(f)` ships `f` to every engine (one MPI rank each)
# and returns the results by rank; `cluster.push` sends data into the engines' namespace. What a function
# prints during a call comes back with its error (a `RemoteTaskError` lists each rank's output and
# traceback); the engine process's own log (start-up, a crash) is `cluster.engine_output(rank)`. Every call has a
# timeout: a rank stuck in a collective its peers never join would otherwise hang the cell. Below, on
# purpose, rank 1 skips a barrier: the call times out, and `cluster.restart()` gives fresh engines.

# %%
cluster = dl.cluster.start(n=2)
cluster.push({"tile_size": 32})                     # data into every engine's namespace
cluster.execute("tile_pixels = tile_size ** 2")     # code run there
print("pulled from the engines:", cluster.pull("tile_pixels"))


def hello():
    import mpi4dl_nb as dl
    ctx = dl.init()
    print(f"engine of rank {ctx.rank} speaking", flush=True)
    return ctx.rank, ctx.world_size


print("results by rank:", cluster.run(hello, timeout=60))
print("last log line of rank 1:", cluster.engine_output(1).strip().splitlines()[-1:] or "(none yet)")


def barrier_on_rank_0_only():
    import mpi4dl_nb as dl
    ctx = dl.init()
    if ctx.rank == 0:
        ctx.barrier()          # rank 1 never joins: a hung collective
    return ctx.rank


try:
    cluster.run(barrier_on_rank_0_only, timeout=3)
except dl.cluster.EngineTimeout as err:
    print("EngineTimeout:", str(err).splitlines()[0])
cluster.restart()
print("after restart:", cluster.run(hello, timeout=60))


# %% [markdown]
# ## Your own layer list, and the error you get for a layer spatial parallelism cannot split
#
# Any `list` of `nn.Module`s is a model: the engine cuts it into stages (`balance`), converts the first
# `spatial_size` stages to tiles (`dl.spatialize`, on each rank), and runs the rest whole. Layers that act on
# each pixel independently or on a window (convs, pools, BatchNorm with global statistics) are exact on
# tiles; a layer that mixes a whole tile (here `nn.LayerNorm` over channels *and* pixels) is refused with a
# `ConfigError` naming the layer and the way out, before any step runs. We convert a first stage on the
# 2 engines (2 tiles side by side):

# %%
def convert_first_stage(norm_name):
    from torch import nn

    import mpi4dl_nb as dl
    norm = nn.BatchNorm2d(8) if norm_name == "BatchNorm2d" else nn.LayerNorm([8, 32, 32])
    my_layers = [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm, nn.ReLU(), nn.MaxPool2d(2)),
                 nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))]
    try:
        dl.spatialize(my_layers[0], dl.TileGrid(1, 2), dl.init())
        return "converts to tiles"
    except dl.ConfigError as err:
        return f"ConfigError: {err}"


for norm_name in ("BatchNorm2d", "LayerNorm"):
    print(f"{norm_name}: {cluster.run(convert_first_stage, norm_name, timeout=60)[0]}")
cluster.stop()

# %% [markdown]
# Put such a layer after the spatial stages (`balance`), or, if your own module *is* exact per pixel,
# register it: `HybridEngine(..., elementwise=(MyModule,))`.

# %% [markdown]
# ## What to try next
#
# * Change `parallel` to `--num-spatial-parts 4 --slice-method square` and predict the world size before
#   running `layout`; then run the training with that `-n`. What does `mpiexec -n 2` print?
# * Point `--datapath` at a folder of your own slides (one sub-folder per class) and lower `--min-tissue`
#   if too few tiles are kept; `--slide-level 1` trains on a coarser level.
# * Replace `nn.LayerNorm` by `nn.GroupNorm(2, 8)` in `my_layers` and see whether it converts.
# * Submit `engines/slurm/train.sbatch` on your cluster; `docs/batch-jobs.md` covers checkpoints, resume
#   and what happens when a rank dies.
