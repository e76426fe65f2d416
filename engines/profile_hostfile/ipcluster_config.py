# ipcluster profile: engines spread over the hosts of a hostfile (MPICH hydra syntax).
# Edit HOSTFILE (one "host:slots" per line), then:
# ipcluster start -n 8 --profile-dir engines/profile_hostfile
c = get_config()  # noqa: F821 - provided by ipcluster
import os  # noqa: E402 - after get_config, as ipcluster profiles read

HOSTFILE = os.environ.get("MPI4DL_HOSTFILE", os.path.expanduser("~/hosts.txt"))
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_MAX_": "0",
              "MALLOC_TRIM_THRESHOLD_": "100000000000", "PYTHONUNBUFFERED": "1"}
args = ["-prepend-rank", "-f", HOSTFILE]
for name, value in ENGINE_ENV.items():
    args += ["-genv", name, value]                  # reach the remote hosts too
c.Cluster.engine_launcher_class = "mpi"
c.MPILauncher.mpi_cmd = ["mpiexec"]
c.MPILauncher.mpi_args = args
# engines on other hosts must reach the controller: listen on every interface
# engines count as registered at their first heartbeat: ping every second (ipyparallel's 3 s held start-up ~2 s)
# (The launcher's setting: ipcluster replaces Cluster.controller_args with its own command line.)
c.LocalControllerLauncher.controller_args = ["--ip=*", "--HeartMonitor.period=1000",
                                             "--HeartMonitor.max_heartmonitor_misses=30"]
