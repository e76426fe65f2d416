"""How a rank waits for MPI: block inside the library, or test and sleep so ranks sharing cores keep computing.

MPICH (and Open MPI) complete a blocking wait by polling: the waiting rank keeps running on
its core (``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` only makes it call ``sched_yield`` between
polls, and Linux still gives it a large share of the core). With more ranks than cores -
the notebook cluster on a laptop, CI's 2 cores - a pipeline stage waiting for its input then
slows the stages that compute: measured here, 3 ranks on 2 cores, a computing rank took
1.6x longer beside one blocked waiter, and no longer beside a rank that tests and sleeps.

``WaitMode.YIELD`` completes requests by ``Test`` and ``time.sleep`` with a short backoff
(20 us doubling to 250 us): the waiting rank leaves the core to the others and notices
completion within the current pause. ``WaitMode.BLOCK`` is the library's own wait: lowest
latency, the right choice when every rank has its own core (or GPU). ``wait_mode_for``
picks YIELD when the node's ranks outnumber its cores, or when its cores are busy already (the
1-minute load average at start at least the cores: a node shared with other jobs). A rank that
polls burns its share of a crowded core, so the scheduler preempts it soon after its input arrives:
measured on 2 cores at load 20-25 (the per-action benchmark in benchmarks/), a tiny forward's median went
from 2.5 ms blocking to 0.34 ms yielding, the peer's (waiting on a condition variable) 0.4 ms.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from typing import Protocol, cast

FIRST_PAUSE = 20e-6
LONGEST_PAUSE = 250e-6
ENV_VAR = "MPI4DL_NB_WAIT"


class WaitMode(str, enum.Enum):
    """``block``: the MPI library's own wait; ``yield``: test, then sleep with backoff."""

    BLOCK = "block"
    YIELD = "yield"

    def __str__(self) -> str:
        return self.value


def node_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def node_load() -> float:
    """The node's 1-minute load average (0 where the system does not tell)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def wait_mode_for(local_ranks: int, cores: int | None = None, requested: str | None = None,
                  load: float | None = None) -> WaitMode:
    """The wait mode of a rank among ``local_ranks`` ranks of its node: ``requested``
    ('block' | 'yield' | 'auto'; None: the ``MPI4DL_NB_WAIT`` variable, else 'auto'); auto
    yields when the ranks outnumber the node's ``cores`` or the node's ``load`` (None: its
    1-minute load average now) is at least its cores."""
    choice = requested if requested is not None else os.environ.get(ENV_VAR, "auto")
    if choice == "auto":
        cores = cores or node_cores()
        crowded = local_ranks > cores or (node_load() if load is None else load) >= cores
        return WaitMode.YIELD if crowded else WaitMode.BLOCK
    try:
        return WaitMode(choice)
    except ValueError:
        raise ValueError(f"wait mode {choice!r}: use auto, block or yield "
                         f"(argument or {ENV_VAR})") from None


class Meeting(Protocol):
    """What ``barrier_asleep`` needs of a context: a barrier over its ranks (and a ``wait_mode``, where it has one)."""

    def barrier(self) -> None: ...


class PacedMeeting(Meeting, Protocol):
    """A context whose waits follow its ``wait_mode`` (``comm.context.Context``)."""

    wait_mode: WaitMode


def barrier_asleep(ctx: Meeting, asleep: bool = True) -> None:
    """``ctx.barrier()``, this rank waiting in it by test and sleep when ``asleep``: a rank idle while another
    computes alone on every core of the node (``tune``'s one-process row and its plan) must not poll one of them:
    beside a polling rank, that process's two torch threads took 30-70x their time on 2 cores (a small Swin's step,
    1.5 s against 0.02 s per rank). A barrier is one collective in either mode, so the others may wait in theirs;
    an object collective is not (in the yielding mode it meets at a barrier first), so only barriers sleep so."""
    mode = getattr(ctx, "wait_mode", None)
    if not asleep or not isinstance(mode, WaitMode):
        ctx.barrier()
        return
    paced = cast(PacedMeeting, ctx)
    paced.wait_mode = WaitMode.YIELD
    try:
        paced.barrier()
    finally:
        paced.wait_mode = mode


def poll(test: Callable[[], bool], first: float = FIRST_PAUSE, longest: float = LONGEST_PAUSE) -> int:
    """Call ``test()`` until it returns True, sleeping between calls (``first`` seconds,
    doubling up to ``longest``; spinning first measured no faster here). Returns the number
    of pauses taken."""
    pause, pauses = first, 0
    while not test():
        time.sleep(pause)
        pauses += 1
        pause = min(longest, 2 * pause)
    return pauses
