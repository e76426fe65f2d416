"""Memory model: every rank's peak over one training step, term by term (docs/planner.md, Memory model)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from ..config import Choice, ParallelConfig
from ..errors import ConfigError
from ..layout import RankRole, StageSlot, layout
from ..pipeline.actions import Action, ActionKind
from ..pipeline.default_cut import check_balance, default_balance, even_balance
from ..pipeline.recompute import segment_bounds
from ..pipeline.schedules import Schedule, build_schedule, stage_ranks
from ..pipeline.split_backward import splits_backward
from .attention import TokenGrid
from .footprint import SplitRun, SplitStage, StageFootprint, StageRole
from .optimizer import OptimizerFactory, StateBytes, TrainingState
from .profile import LayerProfile, Layers, batched, profile_layers
from .segments import recomputed_stage
from .stage_compose import compose_stage
from .tile_footprints import FootprintCache, map_sizes
from .token_tiles import token_grid_of
from .workspace import Workspace

MB = 2 ** 20
TERMS = ("weights", "buffers", "optimizer", "gradients", "persistent", "activations", "halo",
         "boundary", "sent", "buckets", "gathered", "recompute", "working")
STATE_TERMS = ("weights", "gradients", "optimizer")   # a rank's training state, as ZeRO shards it
DEFAULT_CACHE = FootprintCache()
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (the model's output, labels) -> the loss


class Recompute(Choice):
    """Which activations a stage keeps between a chunk's forward and its backward."""

    NONE = "none"            # everything autograd saves
    STAGE = "stage"          # only the stage input and output; the forward re-runs at backward time
    SEGMENTS = "segments"    # the engine's: segment inputs, cut by ``cfg.checkpoint_activations``


@dataclass(frozen=True)
class Precision:
    """Element types: ``activations`` (what layers compute in), ``weights`` (master weights,
    gradients, optimizer state; None: as activations)."""

    activations: torch.dtype = torch.float32
    weights: torch.dtype | None = None

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.weights if self.weights is not None else self.activations

    @property
    def mixed(self) -> bool:
        return self.weight_dtype != self.activations


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimated peak (bytes) and the terms that make it, at its peak moment."""

    rank: int
    role: str
    terms: dict[str, int]
    moment: str = ""           # the action running at the peak
    state: dict[str, int] = field(default_factory=dict)   # the training state it keeps (STATE_TERMS), at any moment

    @property
    def state_bytes(self) -> int:
        """Weights, gradients and optimizer state this rank keeps through the step (its ZeRO share)."""
        return sum(self.state.values())

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def __getattr__(self, name: str) -> int:
        terms = self.__dict__.get("terms", {})
        if name in terms:
            return terms[name]
        raise AttributeError(name)

    # names of the first planner (widgets and notebooks read them)
    @property
    def params(self) -> int:
        return self.terms["weights"] + self.terms["buffers"]

    @property
    def grads(self) -> int:
        return self.terms["gradients"]

    @property
    def transient(self) -> int:
        return self.terms["working"] + self.terms["recompute"] + self.terms["sent"]

    def as_dict(self) -> dict[str, int | str]:
        return {"rank": self.rank, "role": self.role, **self.terms, "total": self.total,
                "moment": self.moment}


@dataclass
class MemoryPlan:
    """The estimate of one configuration: per-rank memory plus what it was computed from."""

    cfg: ParallelConfig
    batch_size: int
    image_size: tuple[int, int]
    balance: tuple[int, ...]
    ranks: list[RankMemory]
    chunk_samples: int
    stages: dict[tuple[int, int | None, bool], StageFootprint] = field(default_factory=dict, repr=False)

    @property
    def totals(self) -> list[int]:
        return [r.total for r in self.ranks]

    @property
    def peak(self) -> int:
        return max(self.totals)

    @property
    def binding_rank(self) -> RankMemory:
        """The rank with the largest peak."""
        return max(self.ranks, key=lambda r: r.total)

    def table(self, terms: Sequence[str] | None = None) -> str:
        """Aligned text table in MB: one row per rank, one column per term, the total."""
        return memory_table(self.ranks, terms)


def memory_table(ranks: Sequence[RankMemory], terms: Sequence[str] | None = None) -> str:
    """Rows of ``ranks`` (MB), columns wide enough for any value (no merged columns)."""
    shown = [t for t in (terms or TERMS) if terms or any(r.terms.get(t, 0) for r in ranks)]
    headers = ["rank", "role", *shown, "total"]
    rows = [[str(r.rank), r.role, *(f"{r.terms.get(t, 0) / MB:.1f}" for t in shown),
             f"{r.total / MB:.1f}"] for r in ranks]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = []
    for row in [headers, *rows]:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:])]
        lines.append("  ".join(cells))
    lines[0] += "   (MB)"
    return "\n".join(lines)


# --------------------------------------------------------------------- the model
def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def _profiles(model: Layers | Sequence[LayerProfile], image_size: tuple[int, int], in_channels: int,
              dtype: torch.dtype) -> list[LayerProfile]:
    items = list(model)
    if all(isinstance(item, LayerProfile) for item in items) and items:
        return [item for item in items if isinstance(item, LayerProfile)]
    return profile_layers([item for item in items if isinstance(item, nn.Module)], image_size, in_channels, dtype)


@dataclass
class StageModel:
    """Footprints of every (stage, tile) of a configuration for one chunk size."""

    cfg: ParallelConfig
    profiles: list[LayerProfile]
    balance: tuple[int, ...]
    chunk: int
    precision: Precision
    cache: FootprintCache
    loss_fn: LossFn = default_loss
    elementwise: Sequence[type] = ()
    workspace: Workspace = Workspace.CPU
    _found: dict[tuple[int, int | None, bool], StageFootprint] = field(default_factory=dict)
    _recomputed: dict[tuple[int, int | None], StageFootprint] = field(default_factory=dict)

    @property
    def bounds(self) -> list[int]:
        return list(itertools.accumulate((0, *self.balance)))

    def role(self, stage: int) -> StageRole:
        if stage < self.cfg.spatial_size:
            return StageRole(self.cfg.grid_shape, self.cfg.halo_d2, self.cfg.fused_layers,
                             tokens=self.token_grid)
        return StageRole()

    @functools.cached_property
    def token_grid(self) -> TokenGrid | None:
        """The image's tokens when a layer of the model makes them (a ViT: tokens on the tiles), else None."""
        return token_grid(self.profiles, self.precision.activations)

    def _loss(self, output: torch.Tensor) -> torch.Tensor:
        target = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)
        return self.loss_fn(output, target) * 1.0

    def split_run(self, stage: int) -> SplitRun:
        """How the layers of ``stage`` are simulated: with the split backward's terms where the engine splits
        it (``split_backward.splits_backward``)."""
        return SplitRun.SPLIT if splits_backward(self.cfg, stage) else SplitRun.NONE

    def footprint(self, stage: int, tile: int | None, grad_held: bool | None = None) -> StageFootprint:
        """One chunk of ``stage`` on the rank holding ``tile`` (None: whole maps)."""
        last = stage == self.cfg.split_size - 1
        held = (not last) if grad_held is None else grad_held
        key = (stage, tile, held)
        found = self._found.get(key)
        if found is None:
            start, stop = self.bounds[stage], self.bounds[stage + 1]
            role = self.role(stage)
            per_layer = []
            for index in range(start, stop):
                profile = self.profiles[index]
                if profile.layer is None:
                    raise ValueError("the memory model simulates the layers: pass the layer list "
                                     "(or profiles made by profile_layers from it)")
                loss = self._loss if last and index == stop - 1 else None
                shapes = [batched(s, self.chunk) for s in profile.in_shapes]
                # a stage's input arrives contiguous (images, a received buffer, joined tiles); later
                # layers get their predecessor's layout (channels-last after a permute back, e.g. ConvNeXt)
                layouts = profile.in_channels_last if index > start else ()
                tiles = self.cache.layer(profile.layer, shapes, self.precision.activations, role,
                                         loss=loss, loss_key=self.loss_fn, elementwise=self.elementwise,
                                         workspace=self.workspace, layouts=layouts,
                                         split=self.split_run(stage))
                per_layer.append(tiles[tile or 0])
            found = compose_stage(per_layer, grad_held=held, split=splits_backward(self.cfg, stage))
            self._found[key] = found
        return found

    def segments(self, stage: int) -> list[tuple[int, int]]:
        """The engine's recomputation segments of ``stage`` (layer ranges within the stage)."""
        setting = self.cfg.checkpoint_activations
        if setting is None:
            raise ConfigError("checkpoint_activations", "per-segment recomputation needs the segment "
                              "setting: set checkpoint_activations ('every', 'blocks' or N)")
        return segment_bounds(self.balance[stage], setting)

    def recomputed(self, stage: int, tile: int | None) -> StageFootprint:
        """One chunk of ``stage`` on ``tile`` run with the engine's per-segment recomputation."""
        key = (stage, tile)
        if key not in self._recomputed:
            grad_held = stage != self.cfg.split_size - 1
            self._recomputed[key] = recomputed_stage(self.footprint(stage, tile), self.segments(stage), grad_held)
        return self._recomputed[key]

    def param_count(self, stage: int) -> int:
        return sum(p.param_count for p in self.profiles[self.bounds[stage]:self.bounds[stage + 1]])

    def buffer_bytes(self, stage: int) -> int:
        scale = _size(self.precision.weight_dtype) / 4
        return int(sum(p.buffer_bytes for p in self.profiles[self.bounds[stage]:self.bounds[stage + 1]])
                   * scale)


def token_grid(profiles: Sequence[LayerProfile], dtype: torch.dtype) -> TokenGrid | None:
    """The token grid the first layer taking images and giving tokens ((N, T, C)) makes, else None."""
    for profile in profiles:
        if profile.layer is not None and profile.in_shapes and len(profile.in_shapes[0]) == 4 \
                and profile.out_shapes and len(profile.out_shapes[0]) == 3:
            return token_grid_of(map_sizes(profile.layer, profile.in_shapes, dtype), profile.out_shapes[0][1])
    return None


HALF_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def settings_of(cfg: ParallelConfig, dtype: torch.dtype, precision: Precision | None,
                recompute: Recompute | str | None) -> tuple[Precision, Recompute]:
    """The element types and recomputation the models use: the explicit arguments if given,
    else ``cfg``'s memory knobs (``cfg.precision`` 'fp32': ``dtype`` throughout, today's
    engine; 'bf16'/'fp16': 16-bit activations with ``dtype`` master weights, gradients and
    optimizer state; ``cfg.checkpoint_activations`` set: ``Recompute.SEGMENTS``, the engine's
    per-segment recomputation with that segment setting, else ``Recompute.NONE``).
    ``Recompute.SEGMENTS`` takes its segments from ``cfg.checkpoint_activations``: refused without."""
    if precision is None:
        half = HALF_TYPES.get(str(cfg.precision))
        precision = Precision(dtype) if half is None else Precision(half, dtype)
    if recompute is None:
        recompute = Recompute.NONE if cfg.checkpoint_activations is None else Recompute.SEGMENTS
    recompute = Recompute(recompute)
    if recompute is Recompute.SEGMENTS and cfg.checkpoint_activations is None:
        raise ConfigError("checkpoint_activations", "recompute='segments' models the engine's "
                          "recomputation, whose segments checkpoint_activations sets ('every', "
                          "'blocks' or N): set it, or use recompute='stage' or 'none'")
    return precision, recompute


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


CHUNK_TERMS = {"activations": "activations", "halo": "halo", "input": "boundary",
               "output": "boundary", "grad_in": "boundary", "output_grads": "activations"}


@dataclass
class _Walk:
    """One rank's memory along its actions (see the module docstring)."""

    model: StageModel
    role: RankRole
    schedule: Schedule
    state_of: Callable[[int], StateBytes]   # stage -> this rank's training state of it (its ZeRO share)
    recompute: Recompute
    holders: dict[tuple[int, int, int], tuple[int, ...]]
    bucketed: frozenset[int] = frozenset()   # stages whose gradients go in buckets posted during backward
    resident: dict[str, int] = field(default_factory=dict)
    chunks: dict[tuple[int, int, int, int], dict[str, int]] = field(default_factory=dict)
    grads: dict[tuple[int, int], int] = field(default_factory=dict)
    sent: int = 0
    pending: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    sends: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    looped: dict[tuple[int, int, int, int], int] = field(default_factory=dict)   # zbv's turn: gradients to itself
    buckets: dict[int, int] = field(default_factory=dict)   # stage -> flat bucket bytes posted, not yet written back
    last_backward: dict[int, Action] = field(default_factory=dict)   # stage -> its last B or I on this rank
    gathering: int = 0   # ZeRO 3: the running stage's weights gathered at once (its layers', or whole; StateBytes)
    peak: int = -1
    at_peak: dict[str, int] = field(default_factory=dict)
    moment: str = ""

    def slots(self) -> list[tuple[int, StageSlot]]:
        return self.role.slots()

    def tile_of(self, replica: int, stage: int) -> int | None:
        for r, slot in self.slots():
            if r == replica and slot.stage == stage:
                return slot.tile
        raise KeyError((replica, stage))

    def fp(self, action: Action) -> StageFootprint:
        """The running chunk's stage footprint, as the stage runs (recomputed by segments or not)."""
        tile = self.tile_of(action.replica, action.stage)
        if self.recompute is Recompute.SEGMENTS:
            return self.model.recomputed(action.stage, tile)
        return self.model.footprint(action.stage, tile)

    def state(self) -> None:
        terms = dict.fromkeys(TERMS, 0)
        for _, slot in self.slots():
            terms["weights"] += self.state_of(slot.stage).weights
            terms["buffers"] += self.model.buffer_bytes(slot.stage)
            terms["optimizer"] += self.state_of(slot.stage).optimizer
            terms["persistent"] += self.model.footprint(slot.stage, slot.tile).persistent
        self.resident = terms

    def kept_state(self) -> dict[str, int]:
        """The training state this rank keeps through the step (STATE_TERMS), its slots together."""
        held = [self.state_of(slot.stage) for _, slot in self.slots()]
        return {"weights": sum(s.weights for s in held), "gradients": sum(s.gradients for s in held),
                "optimizer": sum(s.optimizer for s in held)}

    @staticmethod
    def key(action: Action) -> tuple[int, int, int, int]:
        return (action.replica, action.stage, action.micro_batch, action.copy)

    def hold(self, key: tuple[int, int, int, int], name: str, value: int) -> None:
        held = self.chunks.setdefault(key, dict.fromkeys(CHUNK_TERMS, 0))
        held[name] += value

    def note(self, action: Action, working: int = 0, within: int | None = None,
             key: tuple[int, int, int, int] | None = None, recomputed: int = 0) -> None:
        """A moment: everything held now + ``working``; or, with ``within``, a moment whose
        peak ``within`` already counts chunk ``key``'s held tensors but its input (and
        ``recomputed`` bytes of recomputed activations, shown as their own term)."""
        terms = dict(self.resident)
        terms["gradients"] = sum(self.grads.values())
        inside = 0
        for chunk, held in self.chunks.items():
            for name, value in held.items():
                terms[CHUNK_TERMS[name]] += value
                if chunk == key and name != "input":
                    inside += value
        terms["sent"] = self.sent
        terms["buckets"] = sum(self.buckets.values())
        terms["gathered"] = self.gathering
        working = working if within is None else max(0, within - inside)
        terms["recompute"] = min(recomputed, working)
        terms["working"] = working - terms["recompute"]
        total = sum(terms.values())
        if total > self.peak:
            self.peak, self.at_peak, self.moment = total, terms, action.describe()

    def handoff(self, stage: int) -> bool:
        """Whether ``stage`` joins the tiles of the spatial stage before it (SP -> LP)."""
        return 0 < stage and stage - 1 < self.model.cfg.spatial_size <= stage

    def tile_piece(self, action: Action) -> int:
        """Bytes of the previous (spatial) stage's output on the peer's tile."""
        ranks = self.holders[(action.dp, action.replica, action.stage - 1)]
        return self.model.footprint(action.stage - 1, ranks.index(action.peer)).output_bytes

    def run(self) -> RankMemory:
        self.state()
        actions = self.schedule.actions(self.role.rank)
        # a split backward's weight gradients arrive in its W, or in its I when the stage does not split:
        # the buckets are counted from the last I on
        self.last_backward = {a.stage: a for a in actions
                              if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)}
        for action in actions:
            self.gathering = self.state_of(action.stage).gathered if action.kind.is_compute else 0
            if self.gathering:   # ZeRO 3: the all-gather that brings a layer's (or the stage's) whole weights back
                self.note(action, working=self.state_of(action.stage).gather)
            self.step(action)
        return RankMemory(self.role.rank, self.role.describe(), self.at_peak, self.moment, self.kept_state())

    def step(self, action: Action) -> None:
        kind, key = action.kind, self.key(action)
        if kind is ActionKind.RECV_ACT:
            piece = self.tile_piece(action) if self.handoff(action.stage) else self.fp(action).input_bytes
            self.hold(key, "input", piece)
            self.note(action)
        elif kind is ActionKind.FORWARD:
            self.forward(action, key)
        elif kind is ActionKind.RECV_GRAD:
            if action.peer == self.role.rank:   # zbv's turn: the gradient this rank sent itself, no copy
                self.sent -= self.looped.pop((action.replica, action.stage + 1, action.micro_batch, action.copy), 0)
            self.hold(key, "grad_in", self.fp(action).output_bytes)
            self.note(action)
        elif kind is ActionKind.BACKWARD:
            self.backward(action, key)
        elif kind is ActionKind.BACKWARD_INPUT:
            self.backward(action, key, keep=True)
        elif kind is ActionKind.BACKWARD_WEIGHT:
            self.weight_gradient(action, key)
        elif kind is ActionKind.SEND_GRAD and self.handoff(action.stage):
            self.send_tile_grad(action, key)
        elif kind is ActionKind.ALLREDUCE:
            state = self.state_of(action.stage)
            if state.scatter:   # ZeRO 2, 3: a reduce-scatter into the shards, the whole gradients freed
                self.note(action, working=state.scatter)
                self.grads.update({slot: state.gradients for slot in self.grads if slot[1] == action.stage})
            elif action.stage in self.bucketed:   # the buckets' sums are written into the gradients, then go
                self.note(action)
                self.buckets.pop(action.stage, None)
            else:   # the flat sum of the copies (none for a lone copy: its gradient is the sum)
                copies = sum(1 for _, slot in self.slots() if slot.stage == action.stage)
                alone = copies == 1 and len(action.group) <= 1
                self.note(action, working=0 if alone else state.whole_gradients * copies)
        elif kind is ActionKind.OPTIM:
            self.sent = 0     # the sends are waited for, their buffers released
            self.pending.clear()
            held = [self.state_of(slot.stage) for _, slot in self.slots()]   # the step, then ZeRO 1, 2's all-gather
            self.note(action, working=max(sum(s.step for s in held), max(0 if s.gathered else s.gather for s in held)))

    def forward(self, action: Action, key: tuple[int, int, int, int]) -> None:
        fp = self.fp(action)
        if action.stage == 0:
            self.hold(key, "input", fp.input_bytes)
        joined = fp.input_bytes if self.handoff(action.stage) else 0
        self.note(action, working=joined + fp.forward_peak)
        if joined:   # the received tiles go once the forward returns; the joined map stays
            self.chunks[key]["input"] = joined
        keep = self.recompute is not Recompute.STAGE
        self.hold(key, "activations", fp.saved - fp.halo_kept if keep else 0)
        self.hold(key, "halo", fp.halo_kept if keep else 0)
        self.hold(key, "output", fp.output_bytes)

    def backward(self, action: Action, key: tuple[int, int, int, int], keep: bool = False) -> None:
        """A chunk's backward; ``keep``: only its input-gradient part (``I``), what its ``W`` needs kept
        (a stage the engine does not split runs its whole backward in ``I``)."""
        fp = self.fp(action)
        if keep and fp.split is not None:
            self.input_gradient(action, key, fp.split, fp)
            return
        slot = (action.replica, action.stage)
        grad_bytes = self.state_of(action.stage).whole_gradients
        # the chunk's kept tensors, its output and received gradient are inside the
        # footprint's backward peak; its input stays alive in the runtime throughout
        # (recomputed by segments: inside the footprint's backward peaks already)
        redo = fp.forward_peak if self.recompute is Recompute.STAGE else 0
        if slot not in self.grads:   # this backward creates the stage's gradients
            working = fp.backward_first - fp.grad_bytes + grad_bytes + redo
        else:
            working = fp.backward_later + redo
        if action.stage in self.bucketed and self.last_backward.get(action.stage) is action:
            self.buckets[action.stage] = grad_bytes   # posted during this backward, all of them at most
        self.note(action, within=working, key=key, recomputed=redo or fp.recomputed)
        self.grads[slot] = grad_bytes
        self.chunks.pop(key, None)
        self.send_back(action, fp)

    def send_back(self, action: Action, fp: StageFootprint) -> None:
        """The input gradient, kept by its non-blocking send(s) (none on the first stage)."""
        if action.stage > 0:
            self.sent += fp.input_grad_bytes
            self.pending[self.key(action)] = fp.input_grad_bytes
            if self.role.rank in self.holders[(action.dp, action.replica, action.stage - 1)]:
                self.looped[self.key(action)] = fp.input_grad_bytes   # held until this rank receives it

    def input_gradient(self, action: Action, key: tuple[int, int, int, int], split: SplitStage,
                       fp: StageFootprint) -> None:
        """A split backward's ``I``: the whole graph retained while it runs, then the output gradients kept
        for ``W`` and what the retained graph still holds; the output and the received gradient go, the
        input too unless the graph saved it (pipeline/split_backward.py, ``SplitStage``)."""
        if action.stage in self.bucketed and self.last_backward.get(action.stage) is action:
            self.buckets[action.stage] = self.state_of(action.stage).whole_gradients   # from the last I on, as B's
        self.note(action, within=split.input_peak, key=key)
        held = self.chunks.setdefault(key, dict.fromkeys(CHUNK_TERMS, 0))
        halo = min(held["halo"], split.held)
        held.update(activations=split.held - halo, halo=halo, output=0, grad_in=0, output_grads=split.kept,
                    input=held["input"] if split.keeps_input else 0)
        self.send_back(action, fp)

    def weight_gradient(self, action: Action, key: tuple[int, int, int, int]) -> None:
        """A split backward's weight-gradient part (``W``): the parameter gradients made (the first) or
        added to, then the chunk's kept tensors go. Nothing when the stage's I ran the whole backward."""
        fp = self.fp(action)
        if fp.split is None:
            return
        slot = (action.replica, action.stage)
        self.grads[slot] = self.state_of(action.stage).whole_gradients
        self.note(action, working=fp.split.weight_peak)
        self.chunks.pop(key, None)

    def send_tile_grad(self, action: Action, key: tuple[int, int, int, int]) -> None:
        """SP <- LP: a contiguous copy of each tile's box; the whole gradient goes after the last."""
        self.sent += self.tile_piece(action)
        self.note(action)
        self.sends[key] = self.sends.get(key, 0) + 1
        if self.sends[key] == len(self.holders[(action.dp, action.replica, action.stage - 1)]):
            self.sent -= self.pending.pop(key, 0)


def estimate_memory(model: Layers | Sequence[LayerProfile], cfg: ParallelConfig,
                    image_size: int | tuple[int, int], batch_size: int, *,
                    in_channels: int = 3, dtype: torch.dtype = torch.float32,
                    precision: Precision | None = None, recompute: Recompute | str | None = None,
                    optimizer: OptimizerFactory | None = None, optimizer_states: int | None = None,
                    loss_fn: LossFn = default_loss,
                    elementwise: Sequence[type] = (), cache: FootprintCache | None = None,
                    device: torch.device | str = "cpu") -> MemoryPlan:
    """Per-rank peak memory of ``cfg`` training ``model`` on ``batch_size`` images, by term.

    ``model``: the layer list, or ``profile_layers`` of it. ``dtype`` (or ``precision``):
    element types; ``precision``/``recompute`` None: from ``cfg.precision`` and
    ``cfg.checkpoint_activations`` (see ``settings_of``). ``optimizer``: the factory the
    engine gets (default SGD with momentum; simulated on meta for its state and step
    temporaries); ``optimizer_states`` instead says how many parameter-sized tensors it
    keeps (SGD momentum 1, Adam 2). ``recompute``: which activations a stage keeps (see
    ``Recompute``). The stage cut is the engine's
    (``pipeline.default_cut.default_balance``). ``device``: where the ranks train (the conv
    scratch memory of its backend is added, see ``workspace``).
    """
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    precision, recompute = settings_of(cfg, dtype, precision, recompute)
    profiles = _profiles(model, (height, width), in_channels, precision.activations)
    cfg.validate(batch_size=batch_size, num_layers=len(profiles))
    balance = balance_of(profiles, cfg, (height, width), in_channels)
    chunk = batch_size // cfg.batch_divisor
    stage_model = StageModel(cfg, profiles, balance, chunk, precision, cache or DEFAULT_CACHE,
                             loss_fn, tuple(elementwise), Workspace.for_device(device))
    stage_layers = [[p.layer for p in profiles[a:b] if p.layer is not None]
                    for a, b in itertools.pairwise(stage_model.bounds)]
    training_state = TrainingState(cfg, stage_layers, precision.weight_dtype,
                                   precision.activations if precision.mixed else None, optimizer, optimizer_states,
                                   gathered_together(stage_model, recompute))
    schedule = build_schedule(cfg)
    roles = layout(cfg)
    holders = stage_ranks(cfg, roles)
    ranks = [_Walk(stage_model, role, schedule, functools.partial(training_state.of, role.rank), recompute,
                   holders, bucketed_stages(schedule, role.rank)).run() for role in roles]
    return MemoryPlan(cfg, batch_size, (height, width), balance, ranks, chunk, dict(stage_model._found))


def gathered_together(model: StageModel, recompute: Recompute) -> Callable[[int], list[tuple[int, int]]] | None:
    """Per stage, the layer ranges its recomputation runs together, which ZeRO 3 keeps gathered together (the
    engine's segments; ``Recompute.STAGE``: the whole stage); None without recomputation."""
    if recompute is Recompute.SEGMENTS:
        return model.segments
    if recompute is Recompute.STAGE:
        return lambda stage: [(0, model.balance[stage])]
    return None


def bucketed_stages(schedule: Schedule, rank: int) -> frozenset[int]:
    """The stages whose gradients ``rank`` reduces in buckets posted during backward: with ``grad_bucket_mb``
    set, those it shares with other ranks (as ``PipelineRuntime`` hands them to ``GradientReducer``); none under
    ZeRO 2 and 3, whose reduce-scatter replaces the buckets."""
    if schedule.cfg.grad_bucket_mb is None or schedule.cfg.zero_stage >= 2:
        return frozenset()
    return frozenset(a.stage for a in schedule.actions(rank)
                     if a.kind is ActionKind.ALLREDUCE and len(a.group) > 1)


def balance_of(profiles: Sequence[LayerProfile], cfg: ParallelConfig,
               image_size: int | tuple[int, int] | None = None, in_channels: int | None = None) -> tuple[int, ...]:
    """The stage cut the engine makes for ``cfg`` on ``image_size`` images (``default_cut.default_balance``,
    which keeps layers whose halo is wider than a tile off the spatial stages)."""
    layers = [p.layer for p in profiles if p.layer is not None]
    if len(layers) < len(profiles):
        if cfg.balance is not None:
            return check_balance(cfg.balance, len(profiles), cfg.split_size)
        return even_balance(len(profiles), cfg.split_size)
    return default_balance(layers, cfg, image_size=image_size, in_channels=in_channels)


class _Probe(Enum):
    """``largest_side``'s next guess: interpolated in area, the neighbour of the last one, or the middle."""

    INTERPOLATE = "interpolate"
    NEIGHBOUR = "neighbour"
    MIDDLE = "middle"


def largest_side(peak: Callable[[int], int], budget: float, unit: int, probe: int = 8) -> int:
    """The largest image side, a multiple of ``unit``, whose ``peak(side)`` (bytes, growing with the side, e.g. an
    ``estimate_memory`` plan's ``peak``) is within ``budget``; 0 if ``unit`` itself is not. Peaks grow nearly in
    proportion to the pixels, so the side is interpolated in area between the largest that fits and the smallest
    that does not (extrapolated from ``unit`` and ``probe`` units until one does not fit), then its neighbour is
    tried; where that does not close in, the middle, and again: a few calls.

    >>> largest_side(lambda side: 100 + side * side, 10_000, 14)
    98
    """
    seen: dict[int, float] = {}

    def fits(units: int) -> bool:
        seen[units] = float(peak(units * unit))
        return seen[units] <= budget

    if not fits(1):
        return 0
    low, high, guess, step = 1, 0, max(2, probe), _Probe.INTERPOLATE
    while True:
        if fits(guess):
            low = guess
        else:
            high = guess
        if high == low + 1:
            return low * unit
        if high and step is _Probe.NEIGHBOUR:
            guess, step = (guess + 1 if guess == low else guess - 1), _Probe.MIDDLE
        elif high and step is _Probe.MIDDLE:
            guess, step = (low + high) // 2, _Probe.INTERPOLATE
        else:
            far = high or max(seen)          # the line to the smallest misfit, or on from the largest fit
            far = 1 if far == low else far
            slope = max((seen[far] - seen[low]) / (far * far - low * low), 1e-9)
            area = int((low * low + (budget - seen[low]) / slope) ** 0.5)
            guess = min(high - 1, max(low + 1, area)) if high else max(low + 1, min(area + 1, 64 * low))
            step = _Probe.NEIGHBOUR if high else _Probe.INTERPOLATE
