"""How a notebook cluster's engines are launched: their environment, the controller's and engines' heartbeat settings,
where they run, mpiexec's flags (``comm.launcher``'s), the controller's address and the Slurm batch script."""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence

from ..comm.launcher import RANK_ENV, YIELD_ENV, Launcher, MPIFlavor, rank_environment
from ..config import Choice

#: Environment every engine gets (``comm.launcher``'s rank environment): one thread per rank, a glibc
#: malloc that keeps freed activation memory (where no GPU is visible), and MPICH yielding its core - always, as the
#: notebook's kernel and the controller share the cores with the engines.
ENGINE_ENV: dict[str, str] = {**RANK_ENV, **YIELD_ENV}

#: The controller pings engines every second (ipyparallel's default, 3 s, held every start-up
#: ~2 s: an engine counts as registered only after its first heartbeat) and drops an engine
#: after 30 missed pings; the engines' heart answers from a thread outside the GIL.
CONTROLLER_ARGS = ["--HeartMonitor.period=1000", "--HeartMonitor.max_heartmonitor_misses=30"]

#: Engines end themselves when the controller is gone for 20 heartbeat checks (1.5 s each, ~30 s):
#: remote engines (hostfile, Slurm) outlive a dead driver no longer than that (local ones end at once).
ENGINE_ARGS = ["--IPEngine.max_heartbeat_misses=20"]

#: ipyparallel's engine behind its rank's GPU made current before MPI starts (``engine_main``)
ENGINE_COMMAND = [sys.executable, "-m", "mpi4dl_nb.notebook.engine_main"]


class EnginePlacement(Choice):
    """Where the engines run: this machine, named hosts (``hosts=``), the hosts of a hostfile, or a Slurm job."""

    LOCAL = "local"
    HOSTS = "hosts"
    HOSTFILE = "hostfile"
    SLURM = "slurm"


def mpi_flavor(name: MPIFlavor | str) -> MPIFlavor:
    """``"mpich"``/``"openmpi"`` as an MPIFlavor; ValueError naming both otherwise."""
    try:
        return MPIFlavor(name)
    except ValueError:
        raise ValueError(f"mpi={name!r}: use one of {', '.join(f.value for f in MPIFlavor)}") from None


def mpi_launch_args(flavor: MPIFlavor | str, env: Mapping[str, str], *, as_root: bool | None = None,
                    hostfile: str | None = None, oversubscribe: bool = True) -> list[str]:
    """mpiexec flags for the engine set (rank-tagged output, env export, oversubscription): ``comm.launcher``'s."""
    return Launcher("mpiexec", mpi_flavor(flavor)).flags(env, as_root=as_root, hostfile=hostfile,
                                                        oversubscribe=oversubscribe)


def controller_address(hosts: Sequence[str]) -> str:
    """This machine's address on the way to ``hosts`` (the first that resolves): where a controller must listen
    for engines there to reach it. ValueError naming the hosts when none resolves or none is reachable."""
    problems = []
    for host in hosts:
        try:
            target = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))        # no packet is sent: the kernel picks the route and source
                return str(probe.getsockname()[0])
        except OSError as err:
            problems.append(f"{host}: {err}")
    raise ValueError(f"hosts={list(hosts)!r}: no route from this machine to any of them ({'; '.join(problems)}); "
                     f"check the names (they must resolve here) and the network")


def engine_env(extra: Mapping[str, str] | None = None, n: int = 1) -> dict[str, str]:
    """ENGINE_ENV plus PYTHONPATH so the ``n`` engines import this checkout, plus ``extra``
    (``comm.launcher.rank_environment`` on nothing but this process's PYTHONPATH)."""
    base = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    return rank_environment(n, {**YIELD_ENV, **(extra or {})}, base=base)


def slurm_batch_template(options: Sequence[str], env: Mapping[str, str]) -> str:
    """sbatch script that starts the engines as one ``srun`` MPI job (ipyparallel template)."""
    lines = ["#!/bin/bash", "#SBATCH --job-name=mpi4dl-engines", "#SBATCH --ntasks={n}"]
    lines += [f"#SBATCH {opt}" for opt in options]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()
              if name != "PATH"]
    lines.append("srun {program_and_args} --mpi")
    return "\n".join(lines) + "\n"

