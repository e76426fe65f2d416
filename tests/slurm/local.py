"""A local Slurm for the tests (engines/slurm/local_cluster.sh): started and stopped, its commands, its jobs' ranks."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "engines" / "slurm" / "local_cluster.sh"
BATCH = REPO / "engines" / "slurm" / "train.sbatch"
PROFILE = REPO / "engines" / "profile_slurm"
BIN = Path(sys.executable).parent


def missing() -> list[str]:
    """What this machine lacks for a local Slurm (empty: it can run)."""
    found = [tool for tool in ("slurmctld", "slurmd", "sbatch", "munged")
             if not (shutil.which(tool) or Path("/usr/sbin", tool).exists())]
    needs = [f"{', '.join(found)} (apt: slurm-wlm, munge)"] if found else []
    if os.geteuid() != 0:
        needs.append("root (to start munged, slurmctld and slurmd)")
    return needs


@dataclass
class LocalSlurm:
    """A started local Slurm: its clients' environment, and ``via``, the command prefix that reaches its controller
    (nothing on one node; ``hosts.sh run head`` when its nodes are test hosts)."""

    env: dict[str, str]
    via: list[str] = field(default_factory=list)

    def cmd(self, *args: str, timeout: float = 60, cwd: Path | None = None, env: dict[str, str] | None = None,
            check: bool = True) -> str:
        """Run a Slurm client (or ipcluster) where the controller is reached; its output; asserts it succeeded
        (unless ``check`` is False)."""
        done = subprocess.run([*self.via, *args], env=env or self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
        assert done.returncode == 0 or not check, f"{' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    def run_batch_job(self, script: Path, *args: str, timeout: float, cwd: Path) -> str:
        """Submit ``script`` and wait for it to end (state polled every 0.3 s: ``sbatch --wait`` polls with a
        back-off up to 10 s and returned here ~25 s after the job had ended); its ``scontrol show job`` record."""
        job = self.cmd("sbatch", "--parsable", *args, str(script), timeout=60, cwd=cwd).strip()
        deadline = time.monotonic() + timeout
        while True:
            record = self.cmd("scontrol", "show", "job", "--oneliner", job)
            state = record.split("JobState=", 1)[1].split()[0]
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                outputs = "\n".join(path.read_text()[-3000:] for path in cwd.glob("*.out"))
                assert state == "COMPLETED" and " ExitCode=0:0" in record, f"job {job}: {state}\n{outputs}"
                return record
            if time.monotonic() > deadline:
                self.cmd("scancel", job)
                pytest.fail(f"job {job} still {state} after {timeout} s")
            time.sleep(0.3)

    def marked_ranks(self, program: Sequence[str] = ("-m", "mpi4dl_nb")) -> list[str]:
        """Live python processes carrying this Slurm's marker and running ``program``: the ranks of its jobs (they
        inherit the submit environment)."""
        needle = f"MPI4DL_SLURM_MARK={self.env['MPI4DL_SLURM_MARK']}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                    argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                    if argv[1:1 + len(program)] == list(program):       # a rank (not srun, not this test)
                        found.append(" ".join(argv))
            except OSError:
                continue
        return found

    def wait_until_gone(self, job: str, seconds: float = 30, program: Sequence[str] = ("-m", "mpi4dl_nb")) -> None:
        """Wait until ``job`` has left the queue and none of its ranks lives."""
        deadline = time.monotonic() + seconds
        while self.marked_ranks(program) or self.cmd("squeue", "--noheader", f"--jobs={job}").strip():
            assert time.monotonic() < deadline, f"left after scancel: {self.marked_ranks(program)}"
            time.sleep(0.3)


@contextmanager
def started(state: Path, nodes: int = 1, extra_env: dict[str, str] | None = None) -> Iterator[LocalSlurm]:
    """``local_cluster.sh start [--nodes N]`` with its state in ``state`` (test hosts with ``extra_env``'s
    MPI4DL_HOSTS_* settings for N >= 2), always stopped at the end."""
    env = dict(os.environ, MPI4DL_SLURM_DIR=str(state), MPI4DL_PYTHON=sys.executable,
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               MPI4DL_SLURM_MARK=secrets.token_hex(8), **(extra_env or {}))
    try:
        done = subprocess.run(["bash", str(SCRIPT), "start", "--nodes", str(nodes)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        for line in done.stdout.splitlines():          # export NAME=VALUE lines, as `eval "$(... start)"` takes them
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = value
        via = ["bash", str(REPO / "engines" / "hosts" / "hosts.sh"), "run", "head"] if nodes > 1 else []
        yield LocalSlurm(env, via)
    finally:
        stopped = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
