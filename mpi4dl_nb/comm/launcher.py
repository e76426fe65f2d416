"""The MPI launcher: which ``mpiexec`` (the environment's, else PATH's), its flavour, its flags, the ranks' environment.

One module builds every ``mpiexec`` command line of the project: the notebook cluster's engines, the
test suite's multi-rank jobs and the benchmarks' launches, on this machine or over hosts (``hosts``: the
host of each slot, ranks filling the slots in order and cycling, as MPICH's ``-hosts h1:2,h2:1`` does).
It starts nothing itself.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from itertools import groupby
from pathlib import Path

#: Set in an environment where no MPI job may start (the suite's fast loop, ``pytest -m "not mpi"``).
FORBID_VARIABLE = "MPI4DL_NB_NO_MPIEXEC"

#: The folder holding the ``mpi4dl_nb`` package: ranks import it from there.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

#: CPU ranks: a glibc malloc that keeps freed activation memory instead of unmapping it (no page faults every
#: step; docs/engine.md). Not for GPU ranks: their activations live on the device, and the host heap would keep
#: every freed block (a CPU rank of a GPU node still gets it from ``dl.init``'s ``tune_malloc``).
CPU_MALLOC_ENV: dict[str, str] = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}
#: Every rank: one torch/BLAS thread (a core each, or fewer), CPU_MALLOC_ENV where no GPU is visible.
RANK_ENV: dict[str, str] = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **CPU_MALLOC_ENV, "PYTHONUNBUFFERED": "1"}
#: MPICH's ranks poll while they wait; with more ranks than cores this makes them yield the core.
YIELD_ENV: dict[str, str] = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


class LaunchForbidden(RuntimeError):
    """An MPI job was asked for where none may start (``MPI4DL_NB_NO_MPIEXEC`` is set)."""


class MPIFlavor(str, Enum):
    """The MPI implementation behind an ``mpiexec``: its flags differ."""

    MPICH = "mpich"        # MPICH's hydra (also MVAPICH2, Intel MPI)
    OPENMPI = "openmpi"


def find_mpiexec() -> str:
    """The MPI launcher beside this interpreter (the venv's MPICH wheel), else the one on PATH."""
    candidate = Path(sys.executable).parent / "mpiexec"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found next to this Python nor on PATH; install an MPI "
                           "(pip install mpich) or pass mpiexec=<path>")
    return found


def detect_mpi_flavor(mpiexec: str) -> MPIFlavor:
    """MPICH or Open MPI, from ``mpiexec --version``."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot run {mpiexec!r} --version: {exc}; pass mpi='mpich' or "
                           f"mpi='openmpi' and mpiexec=<path>") from exc
    lowered = text.lower()
    if "open mpi" in lowered or "openrte" in lowered or "open-mpi" in lowered:
        return MPIFlavor.OPENMPI
    if "hydra" in lowered or "mpich" in lowered or "intel" in lowered:
        return MPIFlavor.MPICH
    raise RuntimeError(f"{mpiexec} --version names neither MPICH nor Open MPI:\n{text[:300]}\n"
                       f"pass mpi='mpich' or mpi='openmpi' explicitly")


def check_allowed() -> None:
    """Raise LaunchForbidden where no MPI job may start."""
    if os.environ.get(FORBID_VARIABLE):
        raise LaunchForbidden(f"an MPI job was about to start but {FORBID_VARIABLE} is set (the test "
                              f"suite's `-m \"not mpi\"` loop): mark the test `mpi` or use a launch fixture")


@dataclass(frozen=True)
class Launcher:
    """An ``mpiexec`` and its flavour; builds command lines (``command``) and the flags of a launch (``flags``)."""

    executable: str
    flavor: MPIFlavor

    @classmethod
    def find(cls, mpiexec: str | None = None, flavor: MPIFlavor | str | None = None) -> Launcher:
        """The launcher at ``mpiexec`` (default: ``find_mpiexec()``), its flavour asked of it unless given."""
        if mpiexec is None and flavor is None:
            return _default_launcher()
        executable = mpiexec or find_mpiexec()
        kind = detect_mpi_flavor(executable) if flavor in (None, "auto") else MPIFlavor(flavor)
        return cls(executable, kind)

    def flags(self, env: Mapping[str, str] | None = None, *, tag_output: bool = True, as_root: bool | None = None,
              hostfile: str | None = None, oversubscribe: bool = True, hosts: Sequence[str] | None = None) -> list[str]:
        """Flags of one launch: rank-tagged output, ``env`` exported to every rank (also on other hosts),
        more ranks than cores allowed, a hostfile or ``hosts`` (one name per slot, see ``host_slots``); Open MPI
        also needs ``--allow-run-as-root`` as root."""
        env = env or {}
        if hostfile and hosts:
            raise ValueError("give a hostfile or hosts, not both")
        slots = host_slots(hosts) if hosts else ""
        if self.flavor is MPIFlavor.MPICH:
            args = ["-prepend-rank"] if tag_output else []
            if hostfile:
                args += ["-f", hostfile]
            if slots:
                args += ["-hosts", slots]
            for name, value in env.items():      # hydra exports the environment; -genv makes remote hosts agree
                args += ["-genv", name, value]
            return args
        args = ["--tag-output"] if tag_output else []
        if oversubscribe:
            args.append("--oversubscribe")
        root = os.geteuid() == 0 if as_root is None else as_root
        if root:
            args.append("--allow-run-as-root")
        if hostfile:
            args += ["--hostfile", hostfile]
        if slots:
            args += ["--host", slots, "--map-by", "slot"]
        for name, value in env.items():
            args += ["-x", f"{name}={value}"]
        return args

    def command(self, nprocs: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                tag_output: bool = True, hostfile: str | None = None, hosts: Sequence[str] | None = None) -> list[str]:
        """``mpiexec <flags> -n nprocs argv...``; LaunchForbidden where no MPI job may start."""
        if nprocs < 1:
            raise ValueError(f"nprocs must be at least 1, got {nprocs}")
        check_allowed()
        return [self.executable, *self.flags(env, tag_output=tag_output, hostfile=hostfile, hosts=hosts),
                "-n", str(nprocs), *argv]


@lru_cache(maxsize=1)
def _default_launcher() -> Launcher:
    executable = find_mpiexec()
    return Launcher(executable, detect_mpi_flavor(executable))


def host_slots(hosts: Sequence[str]) -> str:
    """``["h1", "h1", "h2"]`` (one name per slot) as ``"h1:2,h2:1"``, the host list MPICH and Open MPI take."""
    for name in hosts:
        if not name or any(c in name for c in ":, "):
            raise ValueError(f"host name {name!r}: give plain host names, one per slot (repeat a name for more slots)")
    return ",".join(f"{name}:{len(list(slots))}" for name, slots in groupby(hosts))


def placement(nprocs: int, hosts: Sequence[str]) -> list[str]:
    """The host of each of ``nprocs`` ranks: the slots of ``hosts`` in order, cycling when ranks outnumber them."""
    if not hosts:
        raise ValueError("placement needs at least one host")
    return [hosts[rank % len(hosts)] for rank in range(nprocs)]


def ranks_per_node(nprocs: int, hosts: Sequence[str] | None = None) -> int:
    """The most ranks any one node runs: all ``nprocs`` on this machine, else the busiest host of the placement."""
    if not hosts:
        return nprocs
    ranks = placement(nprocs, hosts)
    return max(ranks.count(host) for host in set(ranks))


def rank_environment(nprocs: int, extra: Mapping[str, str] | None = None, *, cores: int | None = None,
                     base: Mapping[str, str] | None = None, hosts: Sequence[str] | None = None,
                     gpus: bool | None = None) -> dict[str, str]:
    """The environment of ``nprocs`` ranks on nodes of ``cores`` cores (default: this machine's), all on this node
    or placed over ``hosts`` (one name per slot): ``base`` (default: this process's) with ``RANK_ENV`` (less
    ``CPU_MALLOC_ENV`` for ranks with ``gpus``, default: whether this machine has a usable GPU), MPICH yielding
    when a node's ranks outnumber its cores, the package on PYTHONPATH, then ``extra``."""
    from .device import cuda_unavailable_reason

    gpus = cuda_unavailable_reason() is None if gpus is None else gpus
    env = dict(os.environ if base is None else base)
    env.update({name: value for name, value in RANK_ENV.items() if not (gpus and name in CPU_MALLOC_ENV)})
    if ranks_per_node(nprocs, hosts) > (cores or os.cpu_count() or 1):
        env.update(YIELD_ENV)
    paths = [str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra or {})
    return env
