# ipcluster profile: the engines are one Slurm job (srun starts one MPI rank per task).
# ipcluster start -n 8 --profile-dir engines/profile_slurm   (from a login node)
# Edit partition/time/account; one GPU per rank: --gpus-per-task=1.
c = get_config()  # noqa: F821 - provided by ipcluster

c.Cluster.engine_launcher_class = "slurm"
c.Cluster.controller_args = ["--ip=*"]
c.SlurmEngineSetLauncher.timelimit = "02:00:00"
c.SlurmEngineSetLauncher.options = "--gpus-per-task=1"
c.SlurmEngineSetLauncher.batch_template = """#!/bin/bash
#SBATCH --job-name=mpi4dl-engines
#SBATCH --ntasks={n}
#SBATCH --partition=gpu
export OMP_NUM_THREADS=1
export MALLOC_MMAP_MAX_=0
export MALLOC_TRIM_THRESHOLD_=100000000000
srun {program_and_args} --mpi
"""
