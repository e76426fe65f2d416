"""The MPI launcher: which ``mpiexec`` (the environment's, else PATH's), its flavour, its flags, the ranks' environment.

One module builds every ``mpiexec`` command line of the project: the notebook cluster's engines, the
test suite's multi-rank jobs and the benchmarks' launches. It starts nothing itself.
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
from pathlib import Path

#: Set in an environment where no MPI job may start (the suite's fast loop, ``pytest -m "not mpi"``).
FORBID_VARIABLE = "MPI4DL_NB_NO_MPIEXEC"

#: The folder holding the ``mpi4dl_nb`` package: ranks import it from there.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

#: Every rank: one torch/BLAS thread (a core each, or fewer), and a glibc malloc that keeps freed
#: activation memory instead of unmapping it (no page faults every step; docs/engine.md).
RANK_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "100000000000",
    "PYTHONUNBUFFERED": "1",
}
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
              hostfile: str | None = None, oversubscribe: bool = True) -> list[str]:
        """Flags of one launch: rank-tagged output, ``env`` exported to every rank (also on other hosts),
        more ranks than cores allowed, a hostfile; Open MPI also needs ``--allow-run-as-root`` as root."""
        env = env or {}
        if self.flavor is MPIFlavor.MPICH:
            args = ["-prepend-rank"] if tag_output else []
            if hostfile:
                args += ["-f", hostfile]
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
        for name, value in env.items():
            args += ["-x", f"{name}={value}"]
        return args

    def command(self, nprocs: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                tag_output: bool = True, hostfile: str | None = None) -> list[str]:
        """``mpiexec <flags> -n nprocs argv...``; LaunchForbidden where no MPI job may start."""
        if nprocs < 1:
            raise ValueError(f"nprocs must be at least 1, got {nprocs}")
        check_allowed()
        return [self.executable, *self.flags(env, tag_output=tag_output, hostfile=hostfile), "-n", str(nprocs),
                *argv]


@lru_cache(maxsize=1)
def _default_launcher() -> Launcher:
    executable = find_mpiexec()
    return Launcher(executable, detect_mpi_flavor(executable))


def rank_environment(nprocs: int, extra: Mapping[str, str] | None = None, *, cores: int | None = None,
                     base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of ``nprocs`` ranks on one node of ``cores`` cores (default: this machine's): ``base``
    (default: this process's) with ``RANK_ENV``, MPICH yielding when ranks outnumber cores, the package on
    PYTHONPATH, then ``extra``."""
    env = dict(os.environ if base is None else base)
    env.update(RANK_ENV)
    if nprocs > (cores or os.cpu_count() or 1):
        env.update(YIELD_ENV)
    paths = [str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra or {})
    return env
