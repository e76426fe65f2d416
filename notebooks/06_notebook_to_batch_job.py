# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 06 — From notebook to batch job (mpiexec, Slurm)
#
# Everything the notebook drove through the cluster is the same engine code that batch jobs
# run under `mpiexec` (and Slurm's `srun`). The CLI keeps MPI4DL's flag names.

# %%
import torch

import mpi4dl_nb as dl

torch.set_num_threads(1)

# %%
import os
import subprocess
import sys
from pathlib import Path

bin_dir = Path(sys.executable).parent
env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **dl.cluster.ENGINE_ENV)
flags = ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2",
         "--slice-method", "vertical", "--image-size", "32", "--batch-size", "2",
         "--num-layers", "11", "--num-filters", "4", "--num-classes", "2", "--app", "synthetic"]
print(subprocess.run([sys.executable, "-m", "mpi4dl_nb", "layout", *flags], capture_output=True,
                     text=True, env=env, timeout=120).stdout)

# %%
command = [str(bin_dir / "mpiexec"), "-n", "3", sys.executable, "-m", "mpi4dl_nb", "train", *flags,
           "--steps", "2", "--no-progress"]
print(" ".join(command[2:]))
result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
print(result.stdout[-2000:])
print(result.stderr[-2000:])
assert result.returncode == 0


# %% [markdown]
# ## On a Slurm cluster
#
# The same command in an `sbatch` script (one MPI rank per task). The notebook cluster can
# also run there: `dl.cluster.start(n, launcher="slurm", slurm_options=[...])` submits the
# engines as a Slurm job (see `engines/README.md`), or `launcher="hostfile"` spreads
# `mpiexec` over the hosts of a hostfile.

# %%
def sbatch_script(ranks, flags, partition="gpu", hours=2):
    lines = ["#!/bin/bash", f"#SBATCH --ntasks={ranks}", f"#SBATCH --partition={partition}",
             f"#SBATCH --time={hours}:00:00", "#SBATCH --gpus-per-task=1",
             *(f"export {k}={v}" for k, v in dl.cluster.ENGINE_ENV.items()),
             "srun python -m mpi4dl_nb train " + " ".join(flags)]
    return "\n".join(lines)

print(sbatch_script(3, flags))
print()
print(dl.cluster.slurm_batch_template(["--partition=gpu", "--time=02:00:00"], {"OMP_NUM_THREADS": "1"}))

# %%
one_thread = {"OMP_NUM_THREADS": "1"}
print("mpiexec flags for MPICH:  ", dl.cluster.mpi_launch_args("mpich", one_thread, hostfile="hosts.txt"))
print("mpiexec flags for Open MPI:", dl.cluster.mpi_launch_args("openmpi", one_thread, hostfile="hosts.txt"))
