"""What the time model is built from: layer times profiled on the device, a network model
calibrated by ping-pong, and the node's compute capacity.

``LayerTimer`` runs each layer once per input shape and role on the rank's device with real
tensors - a spatial layer spatialized for one tile alone (``fake_world``'s size oracle), so
its halo packing and decomposed BatchNorm are timed, the wire time is not - and keeps the
median forward and backward seconds. ``Network`` turns bytes and
messages into seconds (``latency + bytes / bandwidth``), ``calibrate_network`` measures it
on the running cluster. ``Node`` says how many ranks compute at full speed at once (CPU
cores shared by the ranks of one node; a GPU per rank).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...comm.allocator import tune_malloc
from ...comm.handles import Group
from ...comm.messages import as_items
from ...comm.protocol import Comm
from ...pipeline.bn_replay import RunningStatsLedger
from ...pipeline.dataparallel import gather_terms, sum_stage_gradients
from ...pipeline.runtime import start_training
from ...spatial.geometry import TileGrid
from .fake_world import FakeComm, FakeWorld, SizeOracle

if TYPE_CHECKING:
    from ...run.measure import JobCalibration
from .footprint import Loss, Shape, StageRole, StructureKeys, map_sizes, spatial_module, tile_shapes

HANDOFF_PROBE_BYTES = 4     # the payload ``run.measure.handoff_seconds`` relays


@dataclass(frozen=True)
class Network:
    """Point-to-point cost ``latency + bytes / bandwidth`` (seconds), collectives from it, and
    what each meeting of a rank group (a halo exchange, a BatchNorm sum) costs on top:
    ``meeting`` always (noticing the others arrived), ``sync`` more while the ranks computing
    outnumber the cores (``run.measure.meeting_cost`` of two ranks and of all ranks); and
    ``waiting_slowdown``: how much slower the ranks filling the cores compute while the other
    ranks of the job wait in their wait mode (``run.measure.waiting_slowdown``); ``handoff``:
    what the sender and the receiver of a stage hand-off each spend on a payload beyond the
    two messages' wire time (bookkeeping, noticing the message, being scheduled again; from
    ``run.measure.handoff_seconds``, a relay through every rank)."""

    latency: float = 20e-6
    bandwidth: float = 5e9
    sync: float = 0.0                  # crowded, with ``sync_work`` seconds of work between meetings
    meeting: float = 0.0
    sync_short: float | None = None    # crowded, with ``short_work`` seconds between (None: ``sync``)
    sync_work: float = 1e-3
    short_work: float = 0.25e-3
    waiting_slowdown: float = 1.0      # ranks filling the cores compute this much slower while the rest wait
    handoff: float = 0.0               # each side's seconds per hand-off payload beyond the wire

    def crowded_meeting(self, work: float) -> float:
        """Extra seconds of a meeting while ranks outnumber cores, ``work`` seconds of compute
        after the previous one: between the two measurements, linear in ``work``, clamped."""
        if self.sync_short is None or work >= self.sync_work:
            return self.sync
        if work <= self.short_work:
            return self.sync_short
        share = (work - self.short_work) / (self.sync_work - self.short_work)
        return self.sync_short + share * (self.sync - self.sync_short)

    def message(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

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
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        runs.append(time.perf_counter() - start)
    return nbytes / max(1e-9, statistics.median(runs[1:]))


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def calibrate_network(ctx: Comm, sizes: Sequence[int] = (1024, 65536, 1 << 20, 8 << 20),
                      repeats: int = 7) -> Network:
    """The job's ``Network``: a ping-pong between ranks 0 and 1 of ``ctx`` and the costs of
    meetings (collective; every rank gets the fit). One rank: the default guess."""
    from ...run.measure import calibrate_job

    calibration = calibrate_job(ctx)
    return network_of(calibration) if calibration.points else Network()


def network_of(calibration: JobCalibration) -> Network:
    """The ``Network`` of a job's ``run.measure.JobCalibration``: a meeting costs what two
    ranks measured, crowded meetings what all ranks measured beyond that."""
    from ...run.measure import LONG_WORK, SHORT_WORK

    pair = calibration.pair_seconds
    network = fit_network(calibration.points, sync=max(0.0, calibration.crowd_seconds - pair), meeting=pair)
    handoff = max(0.0, calibration.handoff_seconds - 2 * network.message(HANDOFF_PROBE_BYTES)) / 2
    return replace(network, sync_short=max(0.0, calibration.crowd_short_seconds - pair),
                   sync_work=LONG_WORK, short_work=SHORT_WORK, waiting_slowdown=calibration.waiting_slowdown,
                   handoff=handoff)


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


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one layer's forward and backward on one rank (one chunk), and of its share of
    the engine's work around them, each timed on the engine's own code: ``setup`` (train mode,
    gradients dropped, BatchNorm statistics remembered at the step start), ``gradients``
    (flattened for the stage's all-reduce and copied back, one holder), ``replay`` (BatchNorm
    running statistics replayed from one chunk's terms, ``pipeline.bn_replay``) and
    ``replay_chunk`` (each further chunk), ``optimizer`` (SGD with momentum on its parameters),
    ``terms_exchange`` (one chunk's BatchNorm terms packed for the holders' sum and unpacked,
    ``dataparallel.gather_terms``, when several ranks hold the stage)."""

    forward: float
    backward: float
    optimizer: float = 0.0
    replay: float = 0.0
    replay_chunk: float = 0.0
    gradients: float = 0.0
    setup: float = 0.0
    terms_exchange: float = 0.0

    @property
    def bookkeeping(self) -> float:
        """The step's tail for one chunk: optimizer update + BatchNorm replay."""
        return self.optimizer + self.replay

    def reduction(self, chunks: int, holders: int = 1) -> float:
        """This layer's local share of a stage's gradient/statistics action over ``chunks`` chunks
        (``holders`` ranks hold the stage: their BatchNorm terms are exchanged too)."""
        exchange = chunks * self.terms_exchange if holders > 1 else 0.0
        return self.gradients + self.replay + max(0, chunks - 1) * self.replay_chunk + exchange


class LayerTimer:
    """Forward/backward seconds per (layer structure, input shapes, dtype, role), measured
    once on ``device`` with ``threads`` torch threads (the engines' setting)."""

    def __init__(self, device: torch.device | str = "cpu", repeats: int = 5, threads: int = 1) -> None:
        self.device = torch.device(device)
        self.repeats = repeats
        self.threads = threads
        self._found: dict[Hashable, LayerTime] = {}
        self._structure = StructureKeys()
        self.profiled = 0

    def layer(self, layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
              loss: Loss | None = None, loss_key: Hashable = None) -> LayerTime:
        """Time of ``layer`` on the slowest tile of ``role`` (whole maps: the only one)."""
        tile = slowest_tile(role, shapes)
        key = (self._structure(layer), tuple(tuple(s) for s in shapes), dtype, role, tile,
               loss_key if loss is not None else None)
        found = self._found.get(key)
        if found is None:
            found = self._measure(layer, shapes, dtype, role, tile, loss)
            self._found[key] = found
            self.profiled += 1
        return found

    def _measure(self, layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
                 tile: int, loss: Loss | None) -> LayerTime:
        if self.device.type == "cpu":
            tune_malloc()    # as the engines run (dl.init): freed activations reused, no page faults
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            inputs_shapes = list(shapes)
            if role.grid is None:
                module: nn.Module = copy.deepcopy(layer).to(device=self.device, dtype=dtype).train()
            else:
                grid = TileGrid(*role.grid)
                full = next(s for s in shapes if len(s) == 4)
                comm = FakeComm(tile, None, self.device, world_size=grid.num_tiles,
                                sizes=SizeOracle(grid.rows, grid.cols, map_sizes(layer, shapes, dtype)))
                module = spatial_module(layer, grid, comm, role, full, dtype, device=str(self.device))
                inputs_shapes = tile_shapes(shapes, grid, tile)
            return self._run(module, inputs_shapes, dtype, loss)
        finally:
            torch.set_num_threads(threads)

    def _run(self, module: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype,
             loss: Loss | None) -> LayerTime:
        generator = torch.Generator(device=self.device).manual_seed(0)
        inputs = [torch.randn(s, dtype=dtype, device=self.device, generator=generator).requires_grad_(True)
                  for s in shapes]
        x: Any = tuple(inputs) if len(inputs) > 1 else inputs[0]
        ledger = RunningStatsLedger(module)             # the engine's BatchNorm hooks and replay
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=1e-6, momentum=0.9) if params else None
        alone = FakeWorld(1).comm(0, self.device)     # one holder: its collectives return at once
        runs: dict[str, list[float]] = {name: [] for name in _PHASES}
        for _ in range(self.repeats + 1):
            clock = _Clock(self.device)
            start_training(module, module)
            ledger.begin_step()
            clock.lap(runs["setup"])
            with ledger.chunk(0):
                out = module(x)
            if loss is not None:
                out = loss(out)
            clock.lap(runs["forward"])
            outs = [o for o in as_items(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            grads = [torch.ones_like(o) for o in outs]
            clock.lap()
            torch.autograd.backward(outs, grads)
            clock.lap(runs["backward"])
            sum_stage_gradients(alone, [module], None)
            clock.lap(runs["gradients"])
            ledger.replay(ledger.terms)
            clock.lap(runs["replay"])
            ledger.replay({0: ledger.terms.get(0, []), 1: ledger.terms.get(0, [])} if ledger.terms else {})
            clock.lap(runs["two_chunks"])
            if ledger.terms:
                gather_terms(alone, ledger.terms, ONE_HOLDER, ledger)
            clock.lap(runs["terms_exchange"])
            if optimizer is not None:
                optimizer.step()
            clock.lap(runs["optimizer"])
            for t in inputs:
                t.grad = None
            del out, outs, grads
        typical = {name: statistics.median(values[1:]) for name, values in runs.items()}
        return LayerTime(typical["forward"], typical["backward"], typical["optimizer"], typical["replay"],
                         max(0.0, typical["two_chunks"] - typical["replay"]), typical["gradients"],
                         typical["setup"], typical["terms_exchange"])


_PHASES = ("setup", "forward", "backward", "gradients", "replay", "two_chunks", "terms_exchange", "optimizer")
ONE_HOLDER = Group((0,))


class _Clock:
    """Laps of wall time on ``device`` (synchronised before each reading)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        _sync(device)
        self.last = time.perf_counter()

    def lap(self, into: list[float] | None = None) -> None:
        _sync(self.device)
        now = time.perf_counter()
        if into is not None:
            into.append(now - self.last)
        self.last = now


def slowest_tile(role: StageRole, shapes: Sequence[Shape]) -> int:
    """The tile with the largest input area, most neighbours among equals (0 for whole maps)."""
    if role.grid is None:
        return 0
    grid = TileGrid(*role.grid)
    full = next((s for s in shapes if len(s) == 4), None)
    if full is None:
        return 0

    def weight(tile: int) -> tuple[int, int]:
        h, w = grid.tile_of_size(tile, full[-2], full[-1])
        return (h * w, len(grid.neighbors(tile)))

    return max(range(grid.num_tiles), key=weight)
