# ipcluster profile: the engines are one Slurm job (srun starts one MPI rank per task).
#   MPI4DL_SLURM_OPTIONS="--partition=gpu --gpus-per-task=1 --time=02:00:00" \
#       ipcluster start -n 8 --profile-dir engines/profile_slurm        (from a login node, then
#   cluster = dl.cluster.connect(profile_dir="engines/profile_slurm") in the notebook)
# MPI4DL_SLURM_OPTIONS: your site's sbatch options (default --time=02:00:00); the job script is the one
# dl.cluster.start(launcher="slurm") submits (mpi4dl_nb.notebook.cluster.slurm_batch_template), with the
# engine environment of mpi4dl_nb.notebook.cluster.ENGINE_ENV. srun uses the site's MpiDefault MPI plugin.
import os
import shlex

from mpi4dl_nb.notebook.cluster import CONTROLLER_ARGS, ENGINE_ENV, slurm_batch_template

c = get_config()  # noqa: F821 - provided by ipcluster

c.Cluster.engine_launcher_class = "slurm"
# engines on other nodes reach the controller on every interface; heartbeat every second, as dl.cluster.start.
# (The launcher's setting: ipcluster replaces Cluster.controller_args with its own command line.)
c.LocalControllerLauncher.controller_args = ["--ip=*", *CONTROLLER_ARGS]
c.SlurmEngineSetLauncher.batch_template = slurm_batch_template(
    shlex.split(os.environ.get("MPI4DL_SLURM_OPTIONS", "--time=02:00:00")), ENGINE_ENV)
