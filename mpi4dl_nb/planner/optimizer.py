"""What an optimizer keeps (state) and allocates for a step, found by running it on ``meta``; a holder's share of it
under ZeRO."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import ParallelConfig
from ..layout import stage_holders
from ..pipeline.split_backward import splits_backward
from ..sharding.plan import shard_bounds
from ..sharding.zero_stages import ZERO_STAGES, ZeroStage, zero_stage
from .live_bytes import LiveBytes

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum 0.9: the planner's assumption when no optimizer is given."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@dataclass(frozen=True)
class OptimizerFootprint:
    """Bytes for one stage's parameters: gradients, optimizer state, a step's temporaries."""

    grad_bytes: int
    state_bytes: int
    step_bytes: int


_CACHE: dict[tuple, OptimizerFootprint] = {}


def optimizer_footprint(layers: Sequence[nn.Module], dtype: torch.dtype,
                        factory: OptimizerFactory | None = None,
                        states: int | None = None) -> OptimizerFootprint:
    """Gradients, state and step temporaries of ``factory`` on ``layers``' parameters (as
    ``dtype``), from two steps on ``meta`` copies; ``states`` instead: that many
    parameter-sized state tensors and no temporaries."""
    shapes = tuple(tuple(p.shape) for layer in layers for p in layer.parameters() if p.requires_grad)
    size = torch.empty((), dtype=dtype).element_size()
    grad_bytes = sum(_numel(s) for s in shapes) * size
    if states is not None:
        return OptimizerFootprint(grad_bytes, states * grad_bytes, 0)
    key = (shapes, dtype, factory)
    found = _CACHE.get(key)
    if found is None:
        found = _simulate(shapes, dtype, factory or default_optimizer, grad_bytes)
        _CACHE[key] = found
    return found


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _simulate(shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, factory: OptimizerFactory,
              grad_bytes: int) -> OptimizerFootprint:
    if not shapes:
        return OptimizerFootprint(0, 0, 0)
    params = [nn.Parameter(torch.empty(s, dtype=dtype, device="meta")) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer = factory(params)
    live = LiveBytes()
    with live:
        optimizer.step()            # creates the state
        state = live.current
        live.reset_peak()
        optimizer.step()
        step = live.peak - state
    return OptimizerFootprint(grad_bytes, state, max(0, step))


def shard_numel(numel: int, holders: int, index: int) -> int:
    """Elements of a ``numel``-element parameter that holder ``index`` of ``holders`` keeps under ZeRO (the engine's
    ``sharding.plan.shard_bounds``: slices of ceil(numel / holders) in holder order, the last ones shorter or empty)."""
    start, stop = shard_bounds(numel, holders, index)
    return stop - start


@dataclass(frozen=True)
class ZeroShare:
    """Which part of a stage's training state one rank keeps: ``zero_stage`` (``sharding/zero_stages.py``: 0 all of
    it; 1 a shard of the optimizer state, 2 also of the gradients, 3 also of the weights) over ``holders`` ranks,
    this one ``index``."""

    zero_stage: ZeroStage = ZERO_STAGES[0]
    holders: int = 1
    index: int = 0

    @property
    def sharded(self) -> bool:
        return self.zero_stage.shards and self.holders > 1

    def elements(self, numels: Iterable[int]) -> int:
        """This holder's elements of parameters of ``numels`` elements."""
        return sum(shard_numel(n, self.holders, self.index) for n in numels)


@dataclass(frozen=True)
class StateBytes:
    """One rank's training state of one stage under its ZeRO share, as the engine keeps it
    (``sharding/sharded_stage.py``; bytes). Kept between steps: ``weights`` (ZeRO stages 1, 2: the whole weights and the
    shards, a copy; 3: the shards alone), ``gradients`` (ZeRO stages 2, 3: the shards') and ``optimizer`` state (ZeRO
    stages 1-3: the shards'). Transient: ``step`` (the optimizer step's temporaries), ``whole_gradients`` (built by
    backward, kept at ZeRO stages 0, 1, reduce-scattered at 2, 3 by the stage's gradient sum), ``gathered`` (ZeRO stage
    3: the most whole weights present at once while the stage computes: two adjacent layers, or a recomputation
    segment's, or the whole stage where the engine gathers it whole; ``layer_gather``), ``gather`` (an all-gather's flat
    buffer and this rank's piece: after the step at ZeRO stages 1, 2, of the stage; before a use at 3, of the layer
    gathered beside the others) and ``scatter`` (ZeRO stages 2, 3: the reduce-scatter's flat copy of the gradients, its
    piece)."""

    weights: int
    gradients: int
    optimizer: int
    step: int = 0
    whole_gradients: int = 0
    gathered: int = 0
    gather: int = 0
    scatter: int = 0

    @property
    def kept(self) -> int:
        return self.weights + self.gradients + self.optimizer


def layer_numels(layers: Sequence[nn.Module]) -> tuple[tuple[int, ...], ...]:
    """Per layer, the element counts of its trained parameters."""
    return tuple(tuple(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers)


def layer_gather(units: Sequence[tuple[int, int]], together: Sequence[Sequence[int]]) -> tuple[int, int]:
    """ZeRO 3 layer by layer (``sharding/layer_units.py``): the most whole-weight bytes present at once and the
    all-gather beside them (its flat buffer and this rank's piece), for a stage whose *units* (its layers holding
    trained parameters, in order) are ``units`` (whole bytes, this rank's piece bytes). Forward and backward gather a
    unit and prefetch its neighbour (the one before is freed first): two adjacent units at once; ``together``: groups
    of unit indices also present together (a recomputation segment, gathered from its recomputed forward until each
    one's backward). The all-gather counted is that of the group's largest unit (the last gathered, at most).

    >>> layer_gather([(8, 2), (40, 10), (24, 6)], [])       # units 1 and 2: 64 bytes, then 40 + 10 gathering 1
    (64, 50)
    """
    groups: list[Sequence[int]] = [(i, i + 1) for i in range(len(units) - 1)] or [range(len(units))]
    found = [(sum(units[i][0] for i in group), max(sum(units[i]) for i in group))
             for group in [*groups, *together] if group]
    return max(found, key=sum, default=(0, 0))


def zero_state_bytes(found: OptimizerFootprint, numels: Sequence[int], share: ZeroShare, weight_bytes: int,
                layered: tuple[int, int] | None = None) -> StateBytes:
    """The training state of a stage whose trained parameters have ``numels`` elements on the rank keeping
    ``share``: ``found`` (the stage's whole optimizer footprint) scaled to the rank's elements where the ZeRO stage
    shards it; ``weight_bytes``: the stage's weight bytes (with a compute copy under mixed precision). ``layered``:
    ZeRO stage 3's (gathered, gather) where the engine gathers the stage layer by layer (``layer_gather``); None: the
    whole stage's weights gathered at once (a split backward, layers sharing a parameter)."""
    whole = found.grad_bytes
    if not share.sharded or not numels:
        return StateBytes(weight_bytes, whole, found.state_bytes, found.step_bytes, whole)
    ratio = share.elements(numels) / sum(numels)
    piece = round(whole * ratio)          # this rank's shards of the trained parameters, in the weights' type
    zero = share.zero_stage
    gathered, gather = layered if zero.shards_weights and layered is not None else (whole, whole + piece)
    return StateBytes(
        weights=piece + weight_bytes - whole if zero.shards_weights else weight_bytes,   # else a shard is a slice
        gradients=piece if zero.shards_gradients else whole,
        optimizer=round(found.state_bytes * ratio), step=round(found.step_bytes * ratio), whole_gradients=whole,
        gathered=gathered if zero.shards_weights else 0, gather=gather,
        scatter=whole + piece if zero.shards_gradients else 0)


@dataclass
class TrainingState:
    """Each rank's training state of each stage of ``cfg`` whose layers are ``stages``: the stage's optimizer
    footprint (simulated once per stage) and the rank's share of it under ``cfg.zero_stage`` over the stage's
    holders (``layout.stage_holders``: its tiles, copies and replicas). ``compute``: the compute copy's element
    type under mixed precision (None: none). ``segments``: per stage, the layer ranges (within it) its recomputation
    runs together (None: no recomputation), which ZeRO 3 keeps gathered together."""

    cfg: ParallelConfig
    stages: Sequence[Sequence[nn.Module]]
    dtype: torch.dtype = torch.float32
    compute: torch.dtype | None = None
    optimizer: OptimizerFactory | None = None
    optimizer_states: int | None = None
    segments: Callable[[int], Sequence[tuple[int, int]]] | None = None
    _found: dict[tuple[int, int], StateBytes] = field(default_factory=dict)
    _footprints: dict[int, OptimizerFootprint] = field(default_factory=dict)

    def footprint(self, stage: int) -> OptimizerFootprint:
        """The stage's whole gradients, optimizer state and step temporaries (no sharding)."""
        if stage not in self._footprints:
            self._footprints[stage] = optimizer_footprint(self.stages[stage], self.dtype, self.optimizer,
                                                          self.optimizer_states)
        return self._footprints[stage]

    def share(self, rank: int, stage: int) -> ZeroShare:
        """``rank``'s share of ``stage``: its place among the stage's holders."""
        group = stage_holders(self.cfg, stage)
        return ZeroShare(zero_stage(self.cfg.zero_stage), len(group), group.index(rank) if rank in group else 0)

    def of(self, rank: int, stage: int) -> StateBytes:
        """``rank``'s training state of ``stage`` (bytes; its share under ZeRO)."""
        key = (rank, stage)
        if key not in self._found:
            count = sum(p.numel() for layer in self.stages[stage] for p in layer.parameters())
            weights = count * _itemsize(self.dtype) + (count * _itemsize(self.compute) if self.compute else 0)
            numels = [n for layer in layer_numels(self.stages[stage]) for n in layer]
            share = self.share(rank, stage)
            layered = self.layered(stage, share) if share.zero_stage.shards_weights and share.sharded else None
            self._found[key] = zero_state_bytes(self.footprint(stage), numels, share, weights, layered)
        return self._found[key]

    def layered(self, stage: int, share: ZeroShare) -> tuple[int, int] | None:
        """ZeRO 3's (gathered, gather) of ``stage`` gathered layer by layer (``layer_gather``), as the engine does
        unless the stage splits its backward (zero-bubble schedules) or its layers share a parameter (None: it
        gathers the whole stage per action; docs/sharding.md)."""
        layers = self.stages[stage]
        ids = [id(p) for layer in layers for p in layer.parameters()]
        if splits_backward(self.cfg, stage) or len(ids) != len(set(ids)):
            return None
        size = _itemsize(self.dtype)
        units: list[tuple[int, int]] = []
        place: dict[int, int] = {}          # layer index -> unit index
        for index, numels in enumerate(layer_numels(layers)):
            if numels:
                place[index] = len(units)
                units.append((sum(numels) * size, share.elements(numels) * size))
        runs = self.segments(stage) if self.segments is not None else []
        together = [[place[i] for i in range(start, stop) if i in place] for start, stop in runs]
        return layer_gather(units, together)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
