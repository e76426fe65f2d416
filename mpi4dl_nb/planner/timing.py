"""What the time model is built from besides layer times (``layer_timer``): a network model
calibrated by ping-pong, and the node's compute capacity, measured on the job's device.

``Network`` turns bytes and messages into seconds (``latency + bytes / bandwidth``),
``calibrate_network`` measures it on the running cluster. ``Node`` says how many ranks compute
at full speed at once (CPU cores shared by the ranks of one node; a GPU per rank) and how fast
the job's device copies memory (``Node.measured``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..comm.protocol import Comm
from .crowding import NO_CROWDING, Crowding
from .device import MeasuringDevice
from .layer_timer import measuring_device

if TYPE_CHECKING:
    from ..measure.calibration import JobCalibration

HANDOFF_PROBE_BYTES = 4     # the payload ``measure.calibration.handoff_seconds`` relays


@dataclass(frozen=True)
class Network:
    """Point-to-point cost ``latency + bytes / bandwidth`` (seconds), collectives from it, and
    what each meeting of a rank group (a halo exchange, a BatchNorm sum) costs on top:
    ``meeting`` (noticing the others arrived: ``measure.calibration.meeting_cost`` of two
    ranks); ``handoff``: what the sender and the receiver of a stage hand-off each spend on a
    payload beyond the two messages' wire time (bookkeeping, noticing the message, being
    scheduled again; from ``measure.calibration.handoff_seconds``, a relay through every rank);
    ``crowding``: the crowded-core terms the job measured (``crowding.Crowding``: none unless
    its ranks outnumber a CPU node's cores), which a prediction applies only to configurations
    whose ranks outnumber the cores (``crowding.crowds``)."""

    latency: float = 20e-6
    bandwidth: float = 5e9
    meeting: float = 0.0
    handoff: float = 0.0               # each side's seconds per hand-off payload beyond the wire
    crowding: Crowding = NO_CROWDING

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
        """One line: latency, bandwidth, the meeting costs and what crowded cores add."""
        text = f"latency {self.latency * 1e6:.1f} us, bandwidth {self.bandwidth / 1e9:.2f} GB/s"
        if self.meeting:
            text += f", {self.meeting * 1e3:.2f} ms per meeting"
        if self.handoff:
            text += f", {self.handoff * 1e6:.0f} us per hand-off side"
        crowded = self.crowding.describe()
        return text + (f", {crowded}" if crowded else "")


@dataclass(frozen=True)
class Node:
    """How many ranks compute at full speed at once (``cores``; None: every rank, e.g. one
    GPU each), and how fast the device copies memory (bytes/s)."""

    cores: int | None = None
    copy_bandwidth: float = 5e9

    @classmethod
    def measured(cls, device: MeasuringDevice | torch.device | str) -> Node:
        """The node of the job's ``device``: a CPU's cores shared by its ranks (a GPU: one per
        rank), and its copy speed, measured there."""
        bench = measuring_device(device)
        return cls(bench.cores(), bench.copy_bandwidth())


def calibrate_network(ctx: Comm, sizes: Sequence[int] = (1024, 65536, 1 << 20, 8 << 20),
                      repeats: int = 7) -> Network:
    """The job's ``Network``: a ping-pong between ranks 0 and 1 of ``ctx`` and the costs of
    meetings (collective; every rank gets the fit). One rank: the default guess."""
    from ..measure.calibration import calibrate_job

    calibration = calibrate_job(ctx)
    return network_of(calibration) if calibration.points else Network()


def network_of(calibration: JobCalibration) -> Network:
    """The ``Network`` of a job's ``measure.calibration.JobCalibration``: a meeting costs what two
    ranks measured, a hand-off what the relay measured beyond its wire time, and crowded cores
    what the crowded rounds measured beyond a meeting (none when they did not run)."""
    pair = calibration.pair_seconds
    network = fit_network(calibration.points, meeting=pair)
    handoff = max(0.0, calibration.handoff_seconds - 2 * network.message(HANDOFF_PROBE_BYTES)) / 2
    return replace(network, handoff=handoff, crowding=crowding_of(calibration))


def crowding_of(calibration: JobCalibration) -> Crowding:
    """The crowded-core terms of a calibration: its crowded rounds beyond a meeting of two ranks,
    with the work between meetings they ran; ``NO_CROWDING`` when it ran none (a GPU job, or a
    core per rank)."""
    from ..measure.calibration import LONG_WORK, SHORT_WORK

    rounds = calibration.crowded
    if rounds is None:
        return NO_CROWDING
    pair = calibration.pair_seconds
    return Crowding(max(0.0, rounds.crowd_seconds - pair), max(0.0, rounds.crowd_short_seconds - pair),
                    LONG_WORK, SHORT_WORK, rounds.waiting_slowdown, calibration.ranks)


def fit_network(points: Sequence[tuple[float, float]], meeting: float = 0.0) -> Network:
    """Least-squares ``time = latency + bytes / bandwidth`` over (bytes, seconds) points;
    ``meeting``: the measured cost of a meeting of ranks (``Network``)."""
    n = len(points)
    if n < 2:
        return Network(meeting=meeting)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx if sxx else 0.0
    slope = max(slope, 1e-12)
    latency = max(1e-7, mean_y - slope * mean_x)
    return Network(latency=latency, bandwidth=1.0 / slope, meeting=meeting)
