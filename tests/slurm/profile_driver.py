"""Connect to the engines an ipcluster Slurm profile started and run an exact spatial step on them (run where the
controller is reached: the test hosts' head).

Usage: python -m tests.slurm.profile_driver PROFILE_DIR N. Prints one JSON line: each engine's (rank, world size,
host, output and gradient errors) and the Slurm job each engine runs in.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mpi4dl_nb as dl
from tests.multihost.cluster_driver import spatial_step


def slurm_job_of(pid: int) -> str | None:
    """The Slurm job id a process was started in (from its environment as srun set it), or None."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"SLURM_JOB_ID="):
            return item.split(b"=", 1)[1].decode()
    return None


def main(profile: str, engines: int) -> None:
    with dl.cluster.connect(n=engines, profile_dir=profile, timeout=180) as cluster:
        steps = cluster.run(spatial_step, timeout=180)
        jobs = sorted({str(slurm_job_of(info.pid)) for info in cluster.ranks})
    print(json.dumps({"steps": steps, "jobs": jobs}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
