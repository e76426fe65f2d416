"""Test hosts for the suite: engines/hosts/hosts.sh driven from Python, what it needs, and jobs placed on its hosts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from mpi4dl_nb.comm.launcher import Launcher, MPIFlavor

REPO = Path(__file__).resolve().parents[2]
HOSTS_SH = REPO / "engines" / "hosts" / "hosts.sh"
MPIEXEC = REPO / "engines" / "hosts" / "mpiexec"
TOOLS = {"ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux", "unshare": "util-linux",
         "mountpoint": "util-linux"}


#: Namespace prefixes the suite's host sets use: a letter per kind of set, then the pid of the session that made it.
SUITE_PREFIX = re.compile(r"^(m4[a-z]\d+)-(?:head|h\d+)$")


def suite_prefix(kind: str) -> str:
    """The namespace prefix of a host set this process makes (``kind``: one letter), e.g. ``m4t12345``."""
    return f"m4{kind}{os.getpid()}"


def remove_stale_sets() -> list[str]:
    """Take down host sets earlier sessions left behind when killed (their pid gone); the prefixes removed."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    stale = sorted({m.group(1) for n in namespaces if (m := SUITE_PREFIX.match(n))
                    and not Path(f"/proc/{m.group(1)[3:]}").exists()})
    for prefix in stale:
        with tempfile.TemporaryDirectory() as nowhere:          # no state of theirs is known: namespaces only
            subprocess.run(["bash", str(HOSTS_SH), "down"], capture_output=True, timeout=120,
                           env=dict(os.environ, MPI4DL_HOSTS_DIR=nowhere, MPI4DL_HOSTS_PREFIX=prefix))
    return stale


def missing() -> list[str]:
    """What this machine lacks for test hosts (empty: they can run)."""
    if os.geteuid() != 0:
        return ["root (network namespaces)"]
    absent = sorted({package for tool, package in TOOLS.items() if not shutil.which(tool)})
    if absent:
        return [f"{', '.join(absent)} (apt)"]
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        return ["permission to create network namespaces (CAP_SYS_ADMIN; not inside an unprivileged container)"]
    if Launcher.find().flavor is not MPIFlavor.MPICH:
        return ["MPICH's mpiexec (the test hosts' launcher is hydra's ssh launcher)"]
    return []


@dataclass(frozen=True)
class HostSet:
    """Hosts h1..hN (and the head) that ``hosts.sh up`` made under ``directory`` with namespace ``prefix``."""

    directory: Path
    prefix: str
    count: int

    @property
    def selection(self) -> dict[str, str]:
        """The settings that select these hosts (for hosts.sh, engines/hosts/mpiexec, local_cluster.sh), the
        real mpiexec behind engines/hosts/mpiexec (this interpreter's), and this process as the hosts' owner
        (``up`` then takes them down by itself if this process is killed before its teardown)."""
        return {"MPI4DL_HOSTS_DIR": str(self.directory), "MPI4DL_HOSTS_PREFIX": self.prefix,
                "MPI4DL_MPIEXEC": Launcher.find().executable, "MPI4DL_HOSTS_OWNER": str(os.getpid())}

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with ``selection`` and this interpreter's folder first on PATH."""
        return dict(os.environ, **self.selection,
                    PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))

    @property
    def names(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.count + 1)]

    @property
    def shared(self) -> Path:
        """The directory every host sees."""
        return self.directory / "shared"

    @property
    def scratch(self) -> Path:
        """The node-local directory: this path on every host, each host its own disk behind it."""
        return self.directory / "scratch"

    @property
    def launcher(self) -> Launcher:
        """engines/hosts/mpiexec as a Launcher (MPICH flags; ``hosts=`` places ranks, default round-robin)."""
        return Launcher(str(MPIEXEC), MPIFlavor.MPICH)

    def script(self, *args: str, timeout: float = 120) -> str:
        """Run ``hosts.sh args...``; its output; AssertionError with its output when it fails."""
        done = subprocess.run(["bash", str(HOSTS_SH), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"hosts.sh {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on ``host`` (in the current directory)."""
        return ["bash", str(HOSTS_SH), "run", host, *argv]

    def run(self, host: str, argv: Sequence[str], *, timeout: float = 300, env: Mapping[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to its end; output captured (stderr into stdout)."""
        return subprocess.run(self.command(host, argv), env={**self.env, **(env or {})}, cwd=cwd or REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)

    def start(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, output: IO[str] | int = subprocess.PIPE) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` in a session of its own; its output and errors to ``output`` (a pipe)."""
        return subprocess.Popen(self.command(host, argv), env={**self.env, **(env or {})}, cwd=cwd or REPO,
                                text=True, start_new_session=True, stdout=output, stderr=subprocess.STDOUT)

    def pids(self, host: str) -> list[int]:
        """The processes running on ``host`` now."""
        return [int(p) for p in self.script("pids", host).split()]

    def kill(self, host: str) -> str:
        return self.script("kill", host)

    def revive(self, host: str) -> str:
        return self.script("revive", host)

    def down(self) -> str:
        return self.script("down")

    def left_behind(self) -> list[str]:
        """Namespaces, name files and state of these hosts that still exist (empty after a clean ``down``)."""
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        left = [f"namespace {n}" for n in namespaces if n.startswith(f"{self.prefix}-")]
        netns = Path("/etc/netns")
        if netns.is_dir():
            left += [f"{p}" for p in netns.iterdir() if p.name.startswith(f"{self.prefix}-")]
        left += [f"{p}" for p in (self.directory / "state", self.directory / "pids") if p.exists()]
        return left
