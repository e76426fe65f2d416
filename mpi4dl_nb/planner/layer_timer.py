"""Layer times measured on the job's device, many layers in interleaved rounds.

``LayerTimer`` has its ``device.MeasuringDevice`` (``TorchDevice``: a real ``torch.device``)
run a layer per input shape and role with real tensors - a spatial layer spatialized for one
tile alone (``fake_world``'s size oracle), so its halo packing and
decomposed BatchNorm are timed, the wire time is not - together with the engine's work around
it, and keeps the median of each phase over its runs. ``LayerTimer.measure`` times many layers
together: each round runs every layer once, so a slow spell of the machine (seconds long where
ranks share cores) falls on a round or two of every layer alike and the median leaves it out.
Timed one layer after another, a spell could take all of one layer's runs: the same stage's
layers summed to 0.146 and 0.191 s in one job a minute apart (2026-11-23; the git history of BENCHMARKS.md).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.allocator import tune_malloc
from ..comm.device import select_device
from ..comm.handles import Group
from ..comm.messages import Payload, as_items
from ..comm.protocol import Comm
from ..comm.waiting import node_cores
from ..pipeline.bn_replay import RunningStatsLedger
from ..pipeline.dataparallel import gather_terms, sum_stage_gradients
from ..pipeline.stage_instance import start_training
from ..spatial.geometry import TileGrid
from .clock import on_wall_clock, work_clock
from .device import LayerTime, MeasuringDevice, TimingRequest, measure_copy_bandwidth
from .fake_world import FakeComm, FakeWorld, SizeOracle
from .footprint import Loss, Shape, StageRole
from .tile_footprints import StructureKeys, map_sizes, spatial_module, tile_shapes
from .token_tiles import RingMember, member_work

_PHASES = ("setup", "forward", "backward", "gradients", "replay", "two_chunks", "terms_exchange", "optimizer",
           "ring_forward", "ring_backward")
ONE_HOLDER = Group((0,))
WALL_SPREAD_SECONDS = 1.0    # the least time the timed rounds of wall-clock layer times span
WALL_ROUNDS = 30


class LayerTimer:
    """Forward/backward seconds per (layer structure, input shapes, dtype, role), measured
    once on ``device`` (the job's: a ``MeasuringDevice``, or a ``torch.device`` / name measured
    by ``TorchDevice``) with ``threads`` torch threads (the engines' setting), ``repeats`` runs
    after a warm-up, each layer's median kept."""

    def __init__(self, device: MeasuringDevice | torch.device | str, repeats: int = 5, threads: int = 1) -> None:
        self.bench = measuring_device(device)
        self.device = self.bench.device
        self.repeats = repeats
        self.threads = threads
        self._found: dict[Hashable, LayerTime] = {}
        self._structure = StructureKeys()
        self.profiled = 0

    def layer(self, layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
              loss: Loss | None = None, loss_key: Hashable = None, images: bool = False) -> LayerTime:
        """Time of ``layer`` on the slowest tile of ``role`` (whole maps: the only one); measured
        now, alone, unless ``measure`` timed it already (``images``: its inputs need no gradient)."""
        request = TimingRequest(layer, tuple(tuple(s) for s in shapes), dtype, role, loss, loss_key, images)
        key = self._key(request, slowest_tile(role, request.shapes))
        if key not in self._found:
            self.measure([request])
        return self._found[key]

    def measure(self, requests: Iterable[TimingRequest]) -> None:
        """Time every request not timed yet, all of them together in interleaved rounds (module
        docstring) on the device; ``layer`` then answers them from memory."""
        pending: dict[Hashable, tuple[TimingRequest, int]] = {}
        for request in requests:
            tile = slowest_tile(request.role, request.shapes)
            key = self._key(request, tile)
            if key not in self._found:
                pending.setdefault(key, (request, tile))
        if not pending:
            return
        times = self.bench.time_layers(list(pending.values()), self.repeats, self.threads)
        for key, found in zip(pending, times):
            self._found[key] = found
        self.profiled += len(pending)

    def _key(self, request: TimingRequest, tile: int) -> Hashable:
        return (self._structure(request.layer), request.shapes, request.dtype, request.role, tile,
                request.loss_key if request.loss is not None else None, request.images)


@dataclass(frozen=True)
class TorchDevice:
    """A real ``torch.device`` to measure on (``device.MeasuringDevice``): layers built and run
    there, copies timed there; a CPU's ranks share this machine's cores, a GPU is one rank's."""

    device: torch.device

    def time_layers(self, pending: Sequence[tuple[TimingRequest, int]], repeats: int,
                    threads: int) -> list[LayerTime]:
        """Each (request, tile)'s LayerTime: every layer built, then run once per round."""
        if self.device.type == "cpu":
            tune_malloc()    # as the engines run (dl.init): freed activations reused, no page faults
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            benches = [_Bench.build(request, tile, self.device) for request, tile in pending]
            inputs = _RandomInputs(self.device, benches)
            start = time.perf_counter()
            for bench in benches:       # the warm-up round
                bench.run_once(inputs)
            for _ in range(timed_rounds(repeats, time.perf_counter() - start, on_wall_clock(self.device))):
                for bench in benches:
                    bench.run_once(inputs)
            return [bench.result() for bench in benches]
        finally:
            torch.set_num_threads(before)

    def copy_bandwidth(self) -> float:
        return measure_copy_bandwidth(self.device)

    def cores(self) -> int | None:
        return node_cores() if self.device.type == "cpu" else None


def timed_rounds(repeats: int, warm_up_seconds: float, wall: bool) -> int:
    """Rounds to time after a warm-up round of ``warm_up_seconds``: ``repeats``, and on the wall clock as many more
    as spread them over ``WALL_SPREAD_SECONDS`` (at most ``WALL_ROUNDS``), so that a spell of another process on the
    machine takes fewer than half of them and the median leaves it out. A small ViT's one-process layers (a round of
    ~40 ms, two threads, so timed by the wall clock) read 1.6x their step in a CI run where 5 rounds took 0.2 s."""
    if not wall or warm_up_seconds <= 0:
        return repeats
    return max(repeats, min(WALL_ROUNDS, math.ceil(WALL_SPREAD_SECONDS / warm_up_seconds)))


def measuring_device(device: MeasuringDevice | torch.device | str) -> MeasuringDevice:
    """Where to measure: ``device`` itself when it measures, else a ``TorchDevice`` on it
    (``"auto"``: the device ``dl.init()`` would give this process, CUDA when visible)."""
    if isinstance(device, (torch.device, str)):
        return TorchDevice(select_device(0) if device == "auto" else torch.device(device))
    return device


class _RandomInputs:
    """Inputs for every bench: views of one random buffer per dtype, as long as the largest input
    (made once, so the rounds hold no per-layer inputs and spend no time drawing numbers)."""

    def __init__(self, device: torch.device, benches: Sequence[_Bench]) -> None:
        generator = torch.Generator(device=device).manual_seed(0)
        longest: dict[torch.dtype, int] = {}
        for bench in benches:
            for shape in bench.shapes:
                longest[bench.dtype] = max(longest.get(bench.dtype, 0), torch.Size(shape).numel())
        self.buffers = {dtype: torch.randn(count, dtype=dtype, device=device, generator=generator)
                        for dtype, count in longest.items()}

    def leaves(self, shapes: Sequence[Shape], dtype: torch.dtype, grad: bool = True) -> list[torch.Tensor]:
        """Fresh leaf tensors of ``shapes`` (requiring gradients when ``grad``) over the random buffer."""
        buffer = self.buffers[dtype]
        return [buffer[:torch.Size(s).numel()].view(s).detach().requires_grad_(grad) for s in shapes]


@dataclass
class _Bench:
    """One layer built to be timed: the module on the device (spatialized for its tile), the
    engine's BatchNorm ledger and optimizer for it, and its runs per phase so far."""

    module: nn.Module
    shapes: list[Shape]
    dtype: torch.dtype
    loss: Loss | None
    device: torch.device
    ledger: RunningStatsLedger
    optimizer: torch.optim.Optimizer | None
    alone: Comm                      # one holder: its collectives return at once
    runs: dict[str, list[float]]
    share: float = 1.0               # of the forward and backward, the rank's (a ViT's patch embedding: its tokens)
    images: bool = False             # its inputs are the step's images: no gradient for them

    @classmethod
    def build(cls, request: TimingRequest, tile: int, device: torch.device) -> _Bench:
        layer, shapes, dtype, role = request.layer, list(request.shapes), request.dtype, request.role
        share = 1.0
        if role.grid is None:
            module: nn.Module = copy.deepcopy(layer).to(device=device, dtype=dtype).train()
        elif role.tokens is not None:   # a ViT's layer on the tile's tokens, with its rings' extra keys
            whole = copy.deepcopy(layer).to(device=device, dtype=dtype).train()
            members = role.tokens.member_tokens(TileGrid(*role.grid))
            module, shapes, share = member_work(whole, shapes, role.tokens, members, tile)
        else:
            grid = TileGrid(*role.grid)
            full = next(s for s in shapes if len(s) == 4)
            comm = FakeComm(tile, None, device, world_size=grid.num_tiles,
                            sizes=SizeOracle(grid.rows, grid.cols, map_sizes(layer, shapes, dtype)))
            module = spatial_module(layer, grid, comm, role, full, dtype, device=str(device))
            shapes = tile_shapes(shapes, grid, tile)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=1e-6, momentum=0.9) if params else None
        return cls(module, shapes, dtype, request.loss, device, RunningStatsLedger(module), optimizer,
                   FakeWorld(1).comm(0, device), {name: [] for name in _PHASES}, share, request.images)

    def run_once(self, inputs: _RandomInputs) -> None:
        """One training step of the layer alone, each phase's seconds recorded."""
        leaves = inputs.leaves(self.shapes, self.dtype, grad=not self.images)
        x: Payload = tuple(leaves) if len(leaves) > 1 else leaves[0]
        runs, ledger, module, alone = self.runs, self.ledger, self.module, self.alone
        clock = _Clock(self.device)
        start_training(module, module)
        ledger.begin_step()
        clock.lap(runs["setup"])
        with ledger.chunk(0):
            out = module(x)
        if self.loss is not None:
            out = self.loss(out)
        clock.lap(runs["forward"])
        outs = [o for o in as_items(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = [torch.ones_like(o) for o in outs]
        clock.lap()
        if outs:     # a first layer without parameters has nothing to differentiate
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
        if self.optimizer is not None:
            self.optimizer.step()
        clock.lap(runs["optimizer"])
        blocks = module.kernel.per_block() if isinstance(module, RingMember) else (0.0, 0.0)
        runs["ring_forward"].append(blocks[0])
        runs["ring_backward"].append(blocks[1])

    def result(self) -> LayerTime:
        """Each phase's median over the runs after the first (the warm-up)."""
        typical = {name: statistics.median(values[1:] or values) for name, values in self.runs.items()}
        return LayerTime(self.share * typical["forward"], self.share * typical["backward"], typical["optimizer"],
                         typical["replay"], max(0.0, typical["two_chunks"] - typical["replay"]), typical["gradients"],
                         typical["setup"], typical["terms_exchange"],
                         (typical["ring_forward"], typical["ring_backward"]))


class _Clock:
    """Laps of ``device.work_clock`` on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last = work_clock(device)

    def lap(self, into: list[float] | None = None) -> None:
        now = work_clock(self.device)
        if into is not None:
            into.append(now - self.last)
        self.last = now


def slowest_tile(role: StageRole, shapes: Sequence[Shape]) -> int:
    """The tile with the largest input area, most neighbours among equals (0 for whole maps)."""
    if role.grid is None:
        return 0
    grid = TileGrid(*role.grid)
    if role.tokens is not None:
        members = role.tokens.member_tokens(grid)
        return members.index(max(members))
    full = next((s for s in shapes if len(s) == 4), None)
    if full is None:
        return 0

    def weight(tile: int) -> tuple[int, int]:
        h, w = grid.tile_of_size(tile, full[-2], full[-1])
        return (h * w, len(grid.neighbors(tile)))

    return max(range(grid.num_tiles), key=weight)
