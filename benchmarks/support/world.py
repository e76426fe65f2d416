"""The world-size guard: stop with the ``mpiexec -n`` a benchmark needs."""

from __future__ import annotations

from mpi4dl_nb.comm.protocol import Comm


def require_world(ctx: Comm, ranks: int, what: str = "", at_least: bool = False) -> None:
    """Exit with ``run with mpiexec -n N`` unless the job has ``ranks`` ranks (or more, ``at_least``)."""
    if ctx.world_size == ranks or (at_least and ctx.world_size > ranks):
        return
    prefix = f"{what}: " if what else ""
    raise SystemExit(f"{prefix}run with mpiexec -n {ranks}{' (or more)' if at_least else ''}; "
                     f"this job has {ctx.world_size} rank(s)")
