"""Hosts of a job as its monitor sees them: monitors spread over hosts, a host lost when all its ranks fall silent.

A rank that stops heartbeating while the other ranks of its host go on is a stalled process (the stall
watchdog's case). When every rank of a host falls silent at once, the host itself is gone: powered off,
cut off the network, or frozen. MPI may never notice (a crashed host sends no TCP reset; the survivors
wait in their collectives forever), so the monitor ends the job, naming the host, after
``LOST_HOST_SECONDS`` of silence, or the armed step timeout when that is shorter.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

LOST_HOST_SECONDS = 30.0     # silence of every rank of a host before it counts as lost


def choose_monitors(hosts: Sequence[str], count: int) -> list[int]:
    """``count`` monitor ranks (fewer in a smaller job): the first rank of each host in order of first appearance,
    then the lowest remaining ranks, so that a lost host leaves a monitor elsewhere when there is an elsewhere."""
    firsts: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        firsts.setdefault(host, rank)
    chosen = list(firsts.values())[:count]
    chosen += [rank for rank in range(len(hosts)) if rank not in chosen][:count - len(chosen)]
    return sorted(chosen)


def ranks_by_host(hosts: Sequence[str]) -> dict[str, list[int]]:
    """Each host with its ranks, hosts in order of their first rank."""
    found: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        found.setdefault(host, []).append(rank)
    return found


def lost_hosts(hosts: Sequence[str], own_host: str, silent_for: Callable[[int], float | None],
               limit: float) -> dict[str, list[int]]:
    """Hosts (other than ``own_host``) whose every rank has been silent longer than ``limit`` seconds, with their
    ranks. ``silent_for(rank)``: seconds since that rank was last heard, None for a rank that said goodbye (a host
    whose ranks finished is not lost). One host only: nothing can be lost."""
    groups = ranks_by_host(hosts)
    if len(groups) < 2:
        return {}
    lost = {}
    for host, ranks in groups.items():
        if host == own_host:
            continue
        silences = [silent_for(rank) for rank in ranks]
        if all(s is not None and s > limit for s in silences):
            lost[host] = ranks
    return lost


def ended_before(hosts: Sequence[str], monitors: Sequence[int], rank: int) -> list[int]:
    """The ranks monitor ``rank`` outlasts at the end of a job (``teardown.py``): those of other hosts that are not
    monitors, or monitors after it. Monitors so end one after another, the first monitor last, and a host lost at
    the end is seen by a monitor elsewhere that can still end the job (none, on one host)."""
    return [other for other, host in enumerate(hosts)
            if host != hosts[rank] and (other not in monitors or other > rank)]


def describe_lost(lost: dict[str, list[int]], silence: float) -> str:
    """``lost host h2 (rank 1): no heartbeat for 31 s``, for one or several hosts."""
    parts = [f"{host} ({'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))})"
             for host, ranks in lost.items()]
    noun = "host" if len(lost) == 1 else "hosts"
    return (f"lost {noun} {', '.join(parts)}: no heartbeat from {'its' if len(lost) == 1 else 'their'} ranks "
            f"for {silence:.0f} s (down, cut off the network, or frozen)")
