# ipcluster profile: N engines as one local MPICH job (oversubscribed laptop/workstation).
# ipcluster start -n 4 --profile-dir engines/profile_mpich   (mpiexec must be on PATH)
# then in the notebook: cluster = dl.cluster.connect(profile_dir="engines/profile_mpich")
c = get_config()  # noqa: F821 - provided by ipcluster

ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",                       # one torch thread per rank
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",          # MPICH yields instead of busy-polling
    "MALLOC_MMAP_MAX_": "0",                      # keep freed activations in the process
    "MALLOC_TRIM_THRESHOLD_": "100000000000",
    "PYTHONUNBUFFERED": "1",
}
c.Cluster.engine_launcher_class = "mpi"
c.MPILauncher.mpi_cmd = ["mpiexec"]
c.MPILauncher.mpi_args = ["-prepend-rank"]
c.MPILauncher.environment = ENGINE_ENV
c.EngineLauncher.engine_args = ["--log-level=WARN"]
# engines count as registered at their first heartbeat: ping every second (ipyparallel's 3 s held start-up ~2 s)
c.Cluster.controller_args = ["--HeartMonitor.period=1000", "--HeartMonitor.max_heartmonitor_misses=30"]
