"""Footprints: what one layer, and one stage, allocates for one chunk on one rank.

A layer runs shape-only on the ``meta`` device under ``LiveBytes`` - spatialized on a
simulated tile group (``fake_world``) when it belongs to a spatial stage - so the numbers
come from the very code the engine runs: the tensors autograd saves, the halo strips a
spatial conv keeps, working buffers, gradients; no memory is used, any image size works.
Layers that look alike (same structure and input shapes) are simulated once.

A stage's footprint is composed from its layers': between two layers the hand-on tensor
is kept if the producer or the consumer saved it for backward; during a layer's forward
its input is alive; during its backward everything the earlier layers kept is alive.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.messages import Payload, as_items
from ..comm.protocol import Comm
from ..config import Choice
from ..models.pieces import Piece
from ..pipeline.split_backward import LayerRecorder, input_backward
from ..spatial.fit import meta_copy
from ..spatial.geometry import TileGrid
from .attention import TokenGrid
from .fake_world import AmbiguousSize, FakeComm, FakeWorld, SizeOracle, Traffic, run_ranks
from .layouts import BackendLayouts
from .live_bytes import LiveBytes, storage_of
from .token_tiles import attention_widths, ring_terms, token_shapes, with_device_kernels, with_ring_kernels
from .workspace import Workspace, instrument, split_phase

Shape = tuple[int, ...]
Loss = Callable[[torch.Tensor], torch.Tensor]   # the last layer's output -> the loss whose backward runs


@dataclass(frozen=True)
class StageRole:
    """How a stage runs on its ranks: whole maps, or tiles of ``grid`` (rows, cols)."""

    grid: tuple[int, int] | None = None
    halo_d2: bool = False
    fused_layers: int = 1
    tokens: TokenGrid | None = None   # a ViT's stage: the image's tokens, each tile's part on its rank

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1] if self.grid is not None else 1


class SplitRun(Choice):
    """Whether a layer's simulation adds the split backward's terms, and how its I runs."""

    NONE = "none"                # no split backward (every schedule but zb1/zbv, and their first stage)
    SPLIT = "split"              # I computes the input's gradient and the layers' output gradients, W the rest


@dataclass(frozen=True)
class SplitTerms:
    """One layer run as the engine's split backward (pipeline/split_backward.py: ``input_backward`` then
    ``WeightWork.run``), bytes: ``kept`` the output gradients its I leaves for W (each storage once: an add
    hands both branches the same gradient); ``input_peak`` the I's worst moment above the forward's held
    tensors (its output gradient, the kept gradients made so far, the input gradient, scratch; nothing the
    forward saved is freed: the graph is retained for W); ``released`` what the forward held (its output
    included) that goes once I is over (the nodes after the last parameter module: only ``out`` held
    them); ``weight_peak`` the W's worst moment above what it starts with (its parameter gradients
    included); ``kept_received``: of ``kept``, the output gradient it was handed (a layer ending in an
    add, or in a parameter module, keeps it as its last module's output gradient)."""

    kept: int = 0
    input_peak: int = 0
    released: int = 0
    weight_peak: int = 0
    kept_received: int = 0

    def times(self, samples: float) -> SplitTerms:
        return SplitTerms(*(round(value * samples) for value in (self.kept, self.input_peak, self.released,
                                                                 self.weight_peak, self.kept_received)))


@dataclass(frozen=True)
class LayerFootprint:
    """One layer, one chunk, one rank (bytes; activations in the simulated dtype).

    ``forward_peak`` counts what the forward allocates (its output included) at its
    worst moment; ``kept`` what it holds for its backward besides its input and output;
    ``backward_peak`` the worst moment of its backward counting ``kept``, its output, the
    output gradient and what backward allocates (its parameter gradients included).
    """

    input_bytes: int
    output_bytes: int
    forward_peak: int
    kept: int
    halo_kept: int          # part of ``kept``: received halo strips saved for backward
    saves_input: bool
    saves_output: bool
    backward_peak: int
    input_grad_bytes: int
    grad_bytes: int
    persistent: int         # what the layer keeps across steps (halo staging buffers, caches)
    forward_traffic: Traffic = field(default_factory=Traffic)
    backward_traffic: Traffic = field(default_factory=Traffic)
    strips_received: int = 0   # halo strips the forward received (a recomputation log keeps them all)
    forward_fixed: int = 0     # of ``forward_peak``, bytes that do not grow with the batch (backend scratch)
    backward_fixed: int = 0    # of ``backward_peak``, the same
    split: SplitTerms = field(default_factory=SplitTerms)   # the engine's split backward (zb1/zbv), if simulated

    @property
    def replay_log(self) -> int:
        """What ``spatial/replay.py`` keeps of this layer's first forward for its recomputation:
        the received halo strips and the BatchNorm statistics (the forward's all-reduced sums)."""
        return self.strips_received + self.forward_traffic.collective_bytes

    def times(self, samples: float) -> LayerFootprint:
        """This footprint (one sample) for ``samples``: every activation term scales with the
        batch; parameter gradients and the backend's fixed scratch do not (per-channel statistics
        are neglected). A fraction scales a per-token layer to a tile's share of the tokens."""
        def n(value: int) -> int:
            return round(value * samples)
        fixed_backward = self.grad_bytes + self.backward_fixed
        return LayerFootprint(
            n(self.input_bytes), n(self.output_bytes), n(self.forward_peak - self.forward_fixed) + self.forward_fixed,
            n(self.kept), n(self.halo_kept), self.saves_input, self.saves_output,
            n(self.backward_peak - fixed_backward) + fixed_backward,
            n(self.input_grad_bytes), self.grad_bytes, n(self.persistent),
            _traffic_times(self.forward_traffic, samples), _traffic_times(self.backward_traffic, samples),
            n(self.strips_received), self.forward_fixed, self.backward_fixed, self.split.times(samples))


def _traffic_times(traffic: Traffic, samples: float) -> Traffic:
    return replace(traffic, message_bytes=round(traffic.message_bytes * samples))


@dataclass(frozen=True)
class StageFootprint:
    """One chunk of one stage on one rank, composed from its layers (see module docstring).

    ``retained``: kept from the forward to the backward (the output included, the input
    not); ``backward_first``/``backward_later``: worst moment of the backward, gradients of
    the stage's parameters excluded, for the first chunk (the layers after the running one
    have created theirs: included) and a later one (all exist: counted by the caller).
    """

    input_bytes: int
    output_bytes: int
    forward_peak: int
    retained: int
    kept_by_layer: tuple[int, ...]
    halo_kept: int
    backward_first: int
    backward_later: int
    input_grad_bytes: int
    grad_bytes: int
    persistent: int
    layers: tuple[LayerFootprint, ...] = ()
    recomputed: int = 0     # part of the backward peaks: activations of a recomputed forward
    split: SplitStage | None = None   # the chunk under the engine's split backward (simulated with split=True)

    @property
    def saved(self) -> int:
        """Retained bytes other than the stage output."""
        return self.retained - self.output_bytes


@dataclass(frozen=True)
class SplitStage:
    """One chunk of a stage under the engine's split backward (from its layers' ``SplitTerms``), bytes.

    ``input_peak``: the I's worst moment, counting the chunk's held tensors (as ``backward_first`` does:
    the output and received gradient included, the input not); ``held``: what the forward kept that the
    retained graph still holds after I (the stage output only if a node before the last parameter module
    saved it); ``kept``: the output gradients kept for W; ``keeps_input``: whether the graph still holds
    the stage input (its first layer saved it; else it went with I); ``weight_peak``: the W's working
    memory above the chunk's held tensors."""

    input_peak: int
    held: int
    kept: int
    keeps_input: bool
    weight_peak: int


# ----------------------------------------------------------------- simulation
def structure_key(module: nn.Module) -> Hashable:
    """What decides a layer's footprint besides its input: its modules and plain settings (a cut model's one-step
    ``Piece``: its step's, wherever it sits, so a ViT's blocks are simulated once)."""
    if type(module) is Piece and len(module.paths) == 1:
        module = module.get_submodule(module.paths[0])
    settings = []
    for name, sub in module.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(sub).items()
                             if not k.startswith("_") and k != "training"
                             and isinstance(v, (bool, int, float, str, tuple))
                             and all(isinstance(x, (bool, int, float, str)) for x in
                                     (v if isinstance(v, tuple) else (v,)))))
        settings.append((name, type(sub).__qualname__, plain))
    return (repr(module), tuple(settings))


def training_meta_copy(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A ``meta`` copy of ``module`` (no memory; the original is untouched), in training mode."""
    copied = meta_copy(module)
    if dtype is not None:
        copied.to(dtype=dtype)
    return copied.train()


def tile_shapes(shapes: Sequence[Shape], grid: TileGrid | None, tile: int) -> list[Shape]:
    """Each item's shape on tile ``tile`` (4-d maps are cut, other tensors stay whole)."""
    if grid is None:
        return [tuple(s) for s in shapes]
    out: list[Shape] = []
    for shape in shapes:
        if len(shape) == 4:
            h, w = grid.tile_of_size(tile, shape[-2], shape[-1])
            out.append((*shape[:-2], h, w))
        else:
            out.append(tuple(shape))
    return out


def _nbytes(items: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in items)


class _ShapeContext(Protocol):
    """The autograd context of ``_Seed``: it carries the seeded tensor's shape."""

    shape: torch.Size


class _Seed(torch.autograd.Function):
    """A scalar whose backward hands ``x`` a fresh gradient the engine frees once used (as
    a received gradient is), instead of one the caller would keep alive."""

    @staticmethod
    def forward(fctx: _ShapeContext, x: torch.Tensor) -> torch.Tensor:
        fctx.shape = x.shape
        return x.new_zeros(())

    @staticmethod
    def backward(fctx: _ShapeContext, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_ones(fctx.shape)


def _backward(out: Payload) -> None:
    outs = [o for o in as_items(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs:
        torch.autograd.backward([_Seed.apply(o) for o in outs])


def _simulate(module: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype,
              comm: FakeComm | None, loss: Loss | None, workspace: Workspace = Workspace.CPU,
              samples: int = 2, layouts: Sequence[bool] = (), split: SplitRun = SplitRun.NONE) -> LayerFootprint:
    """One forward + backward of ``module`` on meta inputs of ``shapes`` (channels-last where
    ``layouts`` says so), counted (with the backend's conv scratch, ``workspace``, for chunks of
    ``samples``)."""
    hooks = instrument(module, workspace, samples)
    try:
        return _counted(module, shapes, dtype, comm, loss, layouts, split)
    finally:
        for handle in hooks:
            handle.remove()


def meta_input(shape: Shape, dtype: torch.dtype, channels_last: bool = False) -> torch.Tensor:
    """An empty ``meta`` tensor of ``shape``, laid out channels-last if asked (4-d only)."""
    layout = torch.channels_last if channels_last and len(shape) == 4 else torch.contiguous_format
    return torch.empty(shape, dtype=dtype, device="meta", memory_format=layout)


def _counted(module: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype,
             comm: FakeComm | None, loss: Loss | None, layouts: Sequence[bool] = (),
             split: SplitRun = SplitRun.NONE) -> LayerFootprint:
    """``_simulate``'s count, the backend's hooks in place: the forward's and the backward's live bytes, what
    stays after each, the traffic of each (and the split backward's terms when ``split`` asks)."""
    flags = [*layouts, *([False] * (len(shapes) - len(layouts)))]
    inputs = [meta_input(shape, dtype, last).requires_grad_(True) for shape, last in zip(shapes, flags)]
    live = LiveBytes()
    traffic = _TrafficWatch(comm, live)
    with BackendLayouts(), live:   # the layouts the ranks' convolutions give (outside the counter)
        out, forward = _count_forward(module, inputs, loss, live)
        traffic.mark()
        backward = _count_backward(module, inputs, out, live)
        del out
        for t in inputs:
            t.grad = None
        remaining = live.by_tag()
        from_backward = max(0, remaining.pop("backward", 0) - backward.grad_bytes)
        from_forward = sum(remaining.values())
    forward_traffic, backward_traffic = traffic.stop()
    split_terms = SplitTerms() if split is SplitRun.NONE else \
        _split_terms(module, shapes, dtype, loss, flags, backward.grad_bytes)
    return LayerFootprint(
        input_bytes=_nbytes(inputs), output_bytes=forward.output_bytes, forward_peak=forward.peak,
        kept=forward.after - forward.output_bytes - from_forward, halo_kept=forward.halo_kept,
        saves_input=forward.saves_input, saves_output=forward.saves_output,
        backward_peak=backward.peak - from_forward - from_backward, input_grad_bytes=backward.input_grad_bytes,
        grad_bytes=backward.grad_bytes, persistent=from_forward + from_backward, forward_traffic=forward_traffic,
        backward_traffic=backward_traffic, strips_received=traffic.strips_forward, forward_fixed=forward.fixed,
        backward_fixed=backward.fixed, split=split_terms)


class _TrafficWatch:
    """A fake communicator's traffic in a layer's forward and in its backward, and the halo strips it receives
    (tagged ``halo`` among the live bytes)."""

    def __init__(self, comm: FakeComm | None, live: LiveBytes) -> None:
        self.comm, self.live = comm, live
        self.received = self.strips_forward = 0
        self.marks = [self._now()]
        if comm is not None:
            comm.on_receive = self._on_receive

    def _now(self) -> Traffic:
        return self.comm.traffic.copy() if self.comm is not None else Traffic()

    def _on_receive(self, buf: torch.Tensor) -> None:
        self.live.retag(buf, "halo")
        self.received += _nbytes([buf])

    def mark(self) -> None:
        """The forward ends: its traffic and strips are what came so far."""
        self.marks.append(self._now())
        self.strips_forward = self.received

    def stop(self) -> tuple[Traffic, Traffic]:
        """The backward ends: the forward's and the backward's traffic; the communicator's hook removed."""
        if self.comm is not None:
            self.comm.on_receive = None
        start, middle, end = *self.marks, self._now()
        return middle.minus(start), end.minus(middle)


@dataclass(frozen=True)
class _ForwardCount:
    """A counted forward: its peak, the live bytes after it, the fixed bytes at the peak, the halo strips kept,
    the output's bytes (owned by the layer) and whether autograd saves the input or the output."""

    peak: int
    after: int
    fixed: int
    halo_kept: int
    output_bytes: int
    saves_input: bool
    saves_output: bool


@dataclass(frozen=True)
class _BackwardCount:
    """A counted backward: its peak above what stayed, the fixed bytes at the peak, the gradients' bytes."""

    peak: int
    fixed: int
    input_grad_bytes: int
    grad_bytes: int


def _count_forward(module: nn.Module, inputs: list[torch.Tensor], loss: Loss | None,
                   live: LiveBytes) -> tuple[Payload, _ForwardCount]:
    """The output of ``module`` (then ``loss``) on ``inputs``, and its count, watching what autograd saves."""
    packed: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.add(storage_of(t)[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(tuple(inputs) if len(inputs) > 1 else inputs[0])
        if loss is not None:
            out = loss(out)
    outs = [t for t in as_items(out) if isinstance(t, torch.Tensor)]
    return out, _ForwardCount(
        peak=live.peak, after=live.current, fixed=live.fixed_at_peak, halo_kept=live.by_tag().get("halo", 0),
        output_bytes=_nbytes([t for t in outs if live.owns(t)]),
        saves_input=bool({storage_of(t)[0] for t in inputs} & packed),
        saves_output=bool({storage_of(t)[0] for t in outs} & packed))


def _count_backward(module: nn.Module, inputs: list[torch.Tensor], out: Payload, live: LiveBytes) -> _BackwardCount:
    """The backward of ``out`` counted from a fresh peak, its live bytes tagged ``backward``."""
    live.tag = "backward"
    live.reset_peak()
    _backward(out)
    return _BackwardCount(peak=live.peak, fixed=live.fixed_at_peak,
                          input_grad_bytes=_nbytes([t.grad for t in inputs if t.grad is not None]),
                          grad_bytes=_nbytes([p.grad for p in module.parameters() if p.grad is not None]))


def _split_terms(module: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, loss: Loss | None,
                 layouts: Sequence[bool], grad_bytes: int) -> SplitTerms:
    """``module`` run once more, its backward split as the engine splits it (``SplitTerms``); inputs
    laid out as ``layouts`` says, ``grad_bytes`` its parameter gradients (left out of ``weight_peak``)."""
    inputs = [meta_input(shape, dtype, last).requires_grad_(True) for shape, last in zip(shapes, layouts)]
    recorder = LayerRecorder(module)
    with BackendLayouts(), LiveBytes() as live, split_phase() as phase:
        with recorder.recording() as calls:
            out = module(tuple(inputs) if len(inputs) > 1 else inputs[0])
            if loss is not None:
                out = loss(out)
        held = live.current
        phase.input_only = True
        outs = [t for t in as_items(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        # the output gradient: a fresh buffer (received, or made by the next layer's I), None for the loss
        grads: list[torch.Tensor | None] = [None if loss is not None else torch.empty_like(t) for t in outs]
        live.reset_peak()
        input_grads, work = input_backward(calls, outs, grads, inputs)
        input_peak = live.peak - held
        phase.input_only = False
        storages = {storage_of(g)[0]: g for _, found in work.layers for g in found
                    if g is not None and live.owns(g)}
        kept = _nbytes([g for g in storages.values()])
        kept_received = _nbytes([g for g in grads if g is not None and storage_of(g)[0] in storages])
        del out, outs, grads, input_grads, storages
        released = held - (live.current - kept)
        live.reset_peak()
        start = live.current
        phase.weight_only = True
        work.run()
        weight_peak = max(0, live.peak - start - grad_bytes)
        for p in module.parameters():
            p.grad = None
    return SplitTerms(kept, input_peak, released, weight_peak, kept_received)


class StructureKeys:
    """``structure_key`` of layers, computed once per live layer object (held weakly: a layer
    made later at a freed layer's address is not taken for it)."""

    def __init__(self) -> None:
        self._keys: weakref.WeakKeyDictionary[nn.Module, Hashable] = weakref.WeakKeyDictionary()

    def __call__(self, layer: nn.Module) -> Hashable:
        key = self._keys.get(layer)
        if key is None:
            key = structure_key(layer)
            self._keys[layer] = key
        return key

    def __len__(self) -> int:
        """Live layers with a remembered key."""
        return len(self._keys)


class FootprintCache:
    """Layer footprints by (structure, input shapes, dtype, role, loss): each simulated once,
    for one sample (a chunk's footprint is the sample's times the chunk size)."""

    def __init__(self) -> None:
        self._found: dict[Hashable, list[LayerFootprint]] = {}
        self._structure = StructureKeys()
        self.simulated = 0

    def layer(self, layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
              loss: Loss | None = None, loss_key: Hashable = None, elementwise: Sequence[type] = (),
              workspace: Workspace = Workspace.CPU, layouts: Sequence[bool] = (),
              split: SplitRun = SplitRun.NONE) -> list[LayerFootprint]:
        """Footprint of ``layer`` on inputs ``shapes`` (whole maps; channels-last where ``layouts``
        says so), one per tile of ``role``; ``split``: with the split backward's terms."""
        samples = shapes[0][0] if shapes and len(shapes[0]) > 0 else 1
        one = [(1, *s[1:]) if len(s) > 0 and s[0] == samples else tuple(s) for s in shapes]
        key = (self._structure(layer), tuple(tuple(s) for s in one), dtype, role,
               loss_key if loss is not None else None, tuple(elementwise), workspace, min(samples, 2),
               tuple(layouts), split)
        found = self._found.get(key)
        if found is None:
            # the conv scratch of one sample differs from that of a batch (workspace.py)
            found = simulate_layer(layer, one, dtype, role, loss, elementwise, workspace, min(samples, 2),
                                   layouts, split)
            self._found[key] = found
            self.simulated += 1
        return found if samples == 1 else [fp.times(samples) for fp in found]


def map_sizes(layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype) -> frozenset[tuple[int, int]]:
    """Every (H, W) of a 4-d tensor going into or out of ``layer``'s modules on whole maps (meta)."""
    found: set[tuple[int, int]] = set()

    def note(value: object) -> None:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                found.add((int(t.shape[-2]), int(t.shape[-1])))

    def hook(module: nn.Module, args: tuple[object, ...], out: object) -> None:
        note(args)
        note(out)

    module = training_meta_copy(layer, dtype)
    handles = [m.register_forward_hook(hook) for m in module.modules()]
    inputs = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
    with torch.no_grad():
        module(tuple(inputs) if len(inputs) > 1 else inputs[0])
    for handle in handles:
        handle.remove()
    return frozenset(found)


def tile_classes(grid: TileGrid, shapes: Sequence[Shape]) -> dict[int, int]:
    """tile -> the first tile with the same input shapes and as many neighbours along each
    axis (such tiles allocate the same bytes: one of them is simulated)."""
    first: dict[tuple[tuple[Shape, ...], tuple[int, int]], int] = {}
    out = {}
    for tile in range(grid.num_tiles):
        sides = grid.neighbors(tile)
        counts = (sum(s in sides for s in ("top", "bottom")), sum(s in sides for s in ("left", "right")))
        key = (tuple(tile_shapes(shapes, grid, tile)), counts)
        out[tile] = first.setdefault(key, tile)
    return out


def spatial_module(layer: nn.Module, grid: TileGrid, comm: Comm, role: StageRole, full: Shape,
                   dtype: torch.dtype | None, elementwise: Sequence[type] = (), device: str = "meta") -> nn.Module:
    """``layer`` (copied to ``device``) spatialized for ``comm``'s tile of ``grid``."""
    from ..spatial.convert import spatialize

    copied = training_meta_copy(layer, dtype) if device == "meta" else \
        copy.deepcopy(layer).to(device=device, dtype=dtype).train()
    return spatialize(nn.Sequential(copied), grid, comm, Group(tuple(range(grid.num_tiles))),
                      image_size=(full[-2], full[-1]), halo_d2=role.halo_d2,
                      fused_layers=role.fused_layers, elementwise=tuple(elementwise))


def simulate_layer(layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
                   loss: Loss | None = None, elementwise: Sequence[type] = (),
                   workspace: Workspace = Workspace.CPU, samples: int = 2,
                   layouts: Sequence[bool] = (), split: SplitRun = SplitRun.NONE) -> list[LayerFootprint]:
    """Footprint of ``layer`` per tile of ``role`` (one for whole maps); inputs are whole maps
    (channels-last where ``layouts`` says so); ``samples``: the chunk size the conv scratch is
    chosen for (``workspace.conv_workspace``); ``split``: with the terms of the engine's split
    backward (``SplitTerms``, a second forward).

    Tiles run alone, answered by a ``SizeOracle`` (one per class of alike tiles); when the
    oracle cannot tell sizes apart, all tiles run together on a threaded ``FakeWorld``.
    """
    if role.grid is None:
        copied = training_meta_copy(with_device_kernels(layer, workspace == Workspace.CPU), dtype)
        return [_simulate(copied, shapes, dtype, None, loss, workspace, samples, layouts, split)]
    if role.tokens is not None:
        return simulate_token_layer(layer, shapes, dtype, role, loss, workspace, samples, split)
    grid = TileGrid(*role.grid)
    full = next((s for s in shapes if len(s) == 4), None)
    if full is None:
        raise ValueError(f"{type(layer).__name__}: a spatial stage needs 4-d (N, C, H, W) inputs")
    oracle = SizeOracle(grid.rows, grid.cols, map_sizes(layer, shapes, dtype))
    try:
        classes = tile_classes(grid, shapes)
        found: dict[int, LayerFootprint] = {}
        for tile in sorted(set(classes.values())):
            comm = FakeComm(tile, None, torch.device("meta"), world_size=grid.num_tiles, sizes=oracle)
            module = spatial_module(layer, grid, comm, role, full, dtype, elementwise)
            found[tile] = _simulate(module, tile_shapes(shapes, grid, tile), dtype, comm, loss, workspace, samples,
                                    layouts, split)
        return [found[classes[tile]] for tile in range(grid.num_tiles)]
    except AmbiguousSize:
        pass
    world = FakeWorld(grid.num_tiles)

    def tile_run(rank: int) -> LayerFootprint:
        comm = world.comm(rank)
        module = spatial_module(layer, grid, comm, role, full, dtype, elementwise)
        return _simulate(module, tile_shapes(shapes, grid, rank), dtype, comm, loss, workspace, samples, layouts,
                         split)

    return run_ranks(world, tile_run)


def simulate_token_layer(layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
                         loss: Loss | None = None, workspace: Workspace = Workspace.CPU, samples: int = 2,
                         split: SplitRun = SplitRun.NONE) -> list[LayerFootprint]:
    """Footprint of a ViT's ``layer`` per tile of ``role`` (its ``tokens`` set): a layer on tokens run alone on
    each tile's tokens (everything but attention acts per token), its rings' blocks in flight and messages
    added (token_tiles.py); the patch embedding (images in) as the whole image's, scaled to the tile's tokens."""
    if role.grid is None or role.tokens is None:
        raise ValueError("simulate_token_layer needs a role with a tile grid and a token grid")
    tokens = role.tokens.member_tokens(TileGrid(*role.grid))
    total = role.tokens.total
    if any(len(s) == 4 for s in shapes):
        (whole,) = simulate_layer(layer, shapes, dtype, StageRole(), loss, (), workspace, samples, (), split)
        return [whole.times(count / total) for count in tokens]
    widths = attention_widths(layer)
    member_layer = with_ring_kernels(layer)   # saves what a ring member saves (no attention weights)
    chunk = shapes[0][0] if shapes and shapes[0] else 1
    found: dict[int, LayerFootprint] = {}
    out = []
    for member, count in enumerate(tokens):
        if count not in found:
            found[count] = simulate_layer(member_layer, token_shapes(shapes, total, count), dtype, StageRole(), loss,
                                          (), workspace, samples, (), split)[0]
        terms = ring_terms(widths, tokens, member, chunk, dtype.itemsize)
        out.append(replace(found[count], forward_peak=found[count].forward_peak + terms.forward_bytes,
                           backward_peak=found[count].backward_peak + terms.backward_bytes,
                           forward_traffic=terms.forward_traffic, backward_traffic=terms.backward_traffic))
    return out


# ------------------------------------------------------------------ composition
def compose_stage(layers: Sequence[LayerFootprint], grad_held: bool = False,
                  output_held: bool = False, split: bool = False) -> StageFootprint:
    """One chunk of a stage from its layers' footprints (see the module docstring).

    ``grad_held``: the output gradient is a received buffer the runtime keeps for the
    whole backward of the stage (every stage but the last), not one freed once used;
    ``output_held``: the output too stays alive for the whole backward (a recomputed
    segment's output, held by the backward that recomputed it); ``split``: the stage's
    backward is split (``SplitStage``, from layers simulated with ``split=True``).
    """
    count = len(layers)
    if count == 0:
        raise ValueError("a stage needs at least one layer")
    # hand-on tensor after layer k kept until backward: saved by its producer or consumer;
    # the stage output (last layer) is held by the runtime until the chunk's backward.
    keeps = [layers[k].saves_output or (k + 1 < count and layers[k + 1].saves_input) or k == count - 1
             for k in range(count)]
    kept = [fp.kept + (fp.output_bytes if keep else 0) for fp, keep in zip(layers, keeps)]
    forward_peak = 0
    before = 0                              # kept by the layers before the running one
    for k, fp in enumerate(layers):
        alive_input = layers[k - 1].output_bytes if k > 0 and not keeps[k - 1] else 0
        forward_peak = max(forward_peak, before + alive_input + fp.forward_peak)
        before += kept[k]
    grads_after = 0
    first = later = 0
    for k in range(count - 1, -1, -1):
        fp = layers[k]
        earlier = sum(kept[:k])
        # backward_peak counts the layer's output as alive: during the layer's backward it
        # is only if the layer saved it or it is the stage output (held by the runtime);
        # a consumer's saved copy went with the consumer's backward
        alive = fp.saves_output or k == count - 1
        own = fp.backward_peak - (0 if alive else fp.output_bytes)
        if k < count - 1:   # the held output gradient, the held output
            own += layers[-1].output_bytes * (int(grad_held) + int(output_held))
        # the layer's own parameter gradients are inside backward_peak: for a later
        # chunk they are the accumulation temporaries, the resident ones counted outside
        first = max(first, earlier + own + grads_after)
        later = max(later, earlier + own)
        grads_after += fp.grad_bytes
    return StageFootprint(
        input_bytes=layers[0].input_bytes, output_bytes=layers[-1].output_bytes,
        forward_peak=forward_peak, retained=sum(kept), kept_by_layer=tuple(kept),
        halo_kept=sum(fp.halo_kept for fp in layers), backward_first=first, backward_later=later,
        input_grad_bytes=layers[0].input_grad_bytes, grad_bytes=sum(fp.grad_bytes for fp in layers),
        persistent=sum(fp.persistent for fp in layers), layers=tuple(layers),
        split=_split_stage(layers, keeps, kept, grad_held) if split else None)


def _split_stage(layers: Sequence[LayerFootprint], keeps: Sequence[bool], kept: Sequence[int],
                 grad_held: bool) -> SplitStage | None:
    """The stage's ``SplitStage`` from its layers' ``SplitTerms`` (None: no parameters, nothing split).

    I is one ``autograd.grad`` over the stage with the graph retained: while layer k's part runs, every
    tensor the forward kept is alive, with the output gradients kept by the layers after k (and the
    received gradient). Once I is over only the nodes after the stage's last parameter module go (nothing
    else references them), each layer before keeps its whole graph for W."""
    if not any(fp.grad_bytes for fp in layers):
        return None
    count, retained = len(layers), sum(kept)
    # the received gradient, unless the last layer keeps it for W (then in its kept); its own input_peak counts it
    received = max(0, layers[-1].output_bytes - layers[-1].split.kept_received) if grad_held else 0
    input_peak = after = 0
    for k in range(count - 1, -1, -1):
        input_peak = max(input_peak, retained + (received if k < count - 1 else 0) + after
                         + layers[k].split.input_peak)
        after += layers[k].split.kept
    released = 0
    for k in range(count - 1, -1, -1):
        fp = layers[k]
        if fp.grad_bytes:   # the last layer with parameters: its nodes after its last parameter module
            released += fp.split.released - (0 if keeps[k] else fp.output_bytes)
            break
        released += kept[k]
    return SplitStage(input_peak=input_peak, held=max(0, retained - released), kept=after,
                      keeps_input=layers[0].saves_input,
                      weight_peak=max(fp.split.weight_peak for fp in layers))
