"""What the time model is built from besides layer times (``layer_timer``): a network model
calibrated by ping-pong, and the node's compute capacity.

``Network`` turns bytes and messages into seconds (``latency + bytes / bandwidth``),
``calibrate_network`` measures it on the running cluster. ``Node`` says how many ranks compute
at full speed at once (CPU cores shared by the ranks of one node; a GPU per rank).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..comm.protocol import Comm
from .layer_timer import sync_device

if TYPE_CHECKING:
    from ..measure.calibration import JobCalibration

HANDOFF_PROBE_BYTES = 4     # the payload ``measure.calibration.handoff_seconds`` relays


@dataclass(frozen=True)
class Network:
    """Point-to-point cost ``latency + bytes / bandwidth`` (seconds), collectives from it, and
    what each meeting of a rank group (a halo exchange, a BatchNorm sum) costs on top:
    ``meeting`` always (noticing the others arrived), ``sync`` more while the ranks computing
    outnumber the cores (``measure.calibration.meeting_cost`` of two ranks and of all ranks); and
    ``waiting_slowdown``: how much slower the ranks filling the cores compute while the other
    ranks of the job wait in their wait mode (``measure.calibration.waiting_slowdown``); ``handoff``:
    what the sender and the receiver of a stage hand-off each spend on a payload beyond the
    two messages' wire time (bookkeeping, noticing the message, being scheduled again; from
    ``measure.calibration.handoff_seconds``, a relay through every rank)."""

    latency: float = 20e-6
    bandwidth: float = 5e9
    sync: float = 0.0                  # crowded, with ``sync_work`` seconds of work between meetings
    meeting: float = 0.0
    sync_short: float | None = None    # crowded, with ``short_work`` seconds between (None: ``sync``)
    sync_work: float = 1e-3
    short_work: float = 0.25e-3
    waiting_slowdown: float = 1.0      # ranks filling the cores compute this much slower while the rest wait
    handoff: float = 0.0               # each side's seconds per hand-off payload beyond the wire
    crowd_members: int = 0             # ranks of the crowded measurement (``sync``; 0: the configuration's)

    def crowded_meeting(self, work: float) -> float:
        """Extra seconds of a meeting while ranks outnumber cores, ``work`` seconds of compute
        after the previous one: between the two measurements, linear in ``work``, clamped."""
        if self.sync_short is None or work >= self.sync_work:
            return self.sync
        if work <= self.short_work:
            return self.sync_short
        share = (work - self.short_work) / (self.sync_work - self.short_work)
        return self.sync_short + share * (self.sync - self.sync_short)

    def group_meeting(self, members: int, work: float, cores: int | None, ranks: int) -> float:
        """Seconds one meeting of ``members`` ranks costs (its small all-reduce's latency included)
        while the other ranks of a job of ``ranks`` wait, ``work`` seconds of compute after the
        previous one. Members on a core each (``cores`` None: a device each): ``meeting``, as two
        ranks measured it. More members than cores take turns, and each meeting waits for some to
        be scheduled: linearly towards ``meeting + crowded_meeting(work)`` at the crowded
        measurement's ranks (``crowd_members``, else ``ranks``)."""
        crowd = self.crowd_members or ranks
        if cores is None or members <= cores or crowd <= cores:
            return self.meeting
        return self.meeting + self.crowded_meeting(work) * min(1.0, (members - cores) / (crowd - cores))

    def message(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def reduction_bytes(self, nbytes: float, ranks: int) -> float:
        """Seconds of a ring all-reduce's ``2(p-1)/p`` share of ``nbytes`` on the wire, without its
        latency (a meeting's cost, measured, holds that)."""
        return 2 * (ranks - 1) * nbytes / ranks / self.bandwidth if ranks > 1 else 0.0

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce: 2(p-1) steps of ``bytes/p``."""
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) * (self.latency + nbytes / ranks / self.bandwidth)

    def describe(self) -> str:
        """One line: latency, bandwidth and the meeting costs."""
        text = f"latency {self.latency * 1e6:.1f} us, bandwidth {self.bandwidth / 1e9:.2f} GB/s"
        if self.meeting:
            text += f", {self.meeting * 1e3:.2f} ms per meeting"
        if self.sync:
            text += f", {self.sync * 1e3:.2f} ms more per meeting of ranks sharing cores"
        if self.handoff:
            text += f", {self.handoff * 1e6:.0f} us per hand-off side"
        return text + (f", compute {self.waiting_slowdown:.2f}x slower beside waiting ranks"
                       if self.waiting_slowdown > 1 else "")


@dataclass(frozen=True)
class Node:
    """How many ranks compute at full speed at once (``cores``; None: every rank, e.g. one
    GPU each), and how fast the device copies memory (bytes/s)."""

    cores: int | None = None
    copy_bandwidth: float = 5e9

    @classmethod
    def this_machine(cls, device: torch.device | str = "cpu") -> Node:
        """CPU: the cores of this machine, copy speed measured; GPU: one device per rank."""
        device = torch.device(device)
        if device.type != "cpu":
            return cls(None, measure_copy_bandwidth(device))
        return cls(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                   measure_copy_bandwidth(device))


def measure_copy_bandwidth(device: torch.device | str = "cpu", nbytes: int = 16 * 2 ** 20,
                           repeats: int = 5) -> float:
    """Bytes per second of a tensor copy on ``device`` (median of ``repeats``)."""
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty_like(source)
    runs = []
    for _ in range(repeats + 1):
        sync_device(device)
        start = time.perf_counter()
        target.copy_(source)
        sync_device(device)
        runs.append(time.perf_counter() - start)
    return nbytes / max(1e-9, statistics.median(runs[1:]))


def calibrate_network(ctx: Comm, sizes: Sequence[int] = (1024, 65536, 1 << 20, 8 << 20),
                      repeats: int = 7) -> Network:
    """The job's ``Network``: a ping-pong between ranks 0 and 1 of ``ctx`` and the costs of
    meetings (collective; every rank gets the fit). One rank: the default guess."""
    from ..measure.calibration import calibrate_job

    calibration = calibrate_job(ctx)
    return network_of(calibration) if calibration.points else Network()


def network_of(calibration: JobCalibration) -> Network:
    """The ``Network`` of a job's ``measure.calibration.JobCalibration``: a meeting costs what two
    ranks measured, crowded meetings what all ranks measured beyond that."""
    from ..measure.calibration import LONG_WORK, SHORT_WORK

    pair = calibration.pair_seconds
    network = fit_network(calibration.points, sync=max(0.0, calibration.crowd_seconds - pair), meeting=pair)
    handoff = max(0.0, calibration.handoff_seconds - 2 * network.message(HANDOFF_PROBE_BYTES)) / 2
    return replace(network, sync_short=max(0.0, calibration.crowd_short_seconds - pair),
                   sync_work=LONG_WORK, short_work=SHORT_WORK, waiting_slowdown=calibration.waiting_slowdown,
                   handoff=handoff, crowd_members=calibration.ranks)


def fit_network(points: Sequence[tuple[float, float]], sync: float = 0.0, meeting: float = 0.0) -> Network:
    """Least-squares ``time = latency + bytes / bandwidth`` over (bytes, seconds) points;
    ``sync``/``meeting``: the measured costs of meetings of ranks (``Network``)."""
    n = len(points)
    if n < 2:
        return Network(sync=sync, meeting=meeting)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx if sxx else 0.0
    slope = max(slope, 1e-12)
    latency = max(1e-7, mean_y - slope * mean_x)
    return Network(latency=latency, bandwidth=1.0 / slope, sync=sync, meeting=meeting)
