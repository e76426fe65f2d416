# ipcluster profile: N engines as one local Open MPI job.
# ipcluster start -n 4 --profile-dir engines/profile_openmpi
c = get_config()  # noqa: F821 - provided by ipcluster
import os  # noqa: E402 - after get_config, as ipcluster profiles read

ENGINE_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_MAX_": "0",
              "MALLOC_TRIM_THRESHOLD_": "100000000000", "PYTHONUNBUFFERED": "1"}
args = ["--tag-output", "--oversubscribe"]          # more ranks than cores is fine here
if os.geteuid() == 0:
    args.append("--allow-run-as-root")              # containers often run as root
for name, value in ENGINE_ENV.items():
    args += ["-x", f"{name}={value}"]               # Open MPI exports only what -x names
c.Cluster.engine_launcher_class = "mpi"
c.MPILauncher.mpi_cmd = ["mpiexec"]
c.MPILauncher.mpi_args = args
c.MPILauncher.environment = ENGINE_ENV
# engines count as registered at their first heartbeat: ping every second (ipyparallel's 3 s held start-up ~2 s)
c.Cluster.controller_args = ["--HeartMonitor.period=1000", "--HeartMonitor.max_heartmonitor_misses=30"]
