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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...comm.handles import Group
from ...comm.messages import as_items
from ...spatial.geometry import TileGrid
from .fake_world import FakeComm, FakeWorld, Traffic, run_ranks
from .live_bytes import LiveBytes, storage_of

Shape = tuple[int, ...]
Loss = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class StageRole:
    """How a stage runs on its ranks: whole maps, or tiles of ``grid`` (rows, cols)."""

    grid: tuple[int, int] | None = None
    halo_d2: bool = False
    fused_layers: int = 1

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1] if self.grid is not None else 1


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
    gathered: tuple[Any, ...] = ()


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

    @property
    def saved(self) -> int:
        """Retained bytes other than the stage output."""
        return self.retained - self.output_bytes


# ----------------------------------------------------------------- simulation
def structure_key(module: nn.Module) -> Hashable:
    """What decides a layer's footprint besides its input: its modules and plain settings."""
    settings = []
    for name, sub in module.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(sub).items()
                             if not k.startswith("_") and k != "training"
                             and isinstance(v, (bool, int, float, str, tuple))
                             and all(isinstance(x, (bool, int, float, str)) for x in
                                     (v if isinstance(v, tuple) else (v,)))))
        settings.append((name, type(sub).__qualname__, plain))
    return (repr(module), tuple(settings))


def meta_copy(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A ``meta`` copy of ``module`` (no memory; the original is untouched), in training mode."""
    copied = copy.deepcopy(module).to(device="meta")
    if dtype is not None:
        copied.to(dtype=dtype)
    return copied.train()


def tile_shapes(shapes: Sequence[Shape], grid: TileGrid | None, tile: int) -> list[Shape]:
    """Each item's shape on tile ``tile`` (4-d maps are cut, other tensors stay whole)."""
    if grid is None:
        return [tuple(s) for s in shapes]
    out = []
    for shape in shapes:
        if len(shape) == 4:
            h, w = grid.tile_of_size(tile, shape[-2], shape[-1])
            out.append((*shape[:-2], h, w))
        else:
            out.append(tuple(shape))
    return out


def _nbytes(items: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in items)


class _Seed(torch.autograd.Function):
    """A scalar whose backward hands ``x`` a fresh gradient the engine frees once used (as
    a received gradient is), instead of one the caller would keep alive."""

    @staticmethod
    def forward(fctx: Any, x: torch.Tensor) -> torch.Tensor:
        fctx.shape = x.shape
        return x.new_zeros(())

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_ones(fctx.shape)


def _backward(out: Any) -> None:
    outs = [o for o in as_items(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs:
        torch.autograd.backward([_Seed.apply(o) for o in outs])


def _simulate(module: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype,
              comm: FakeComm | None, loss: Loss | None) -> LayerFootprint:
    """One forward + backward of ``module`` on meta inputs of ``shapes``, counted."""
    inputs = [torch.empty(shape, dtype=dtype, device="meta").requires_grad_(True) for shape in shapes]
    x = tuple(inputs) if len(inputs) > 1 else inputs[0]
    input_ids = {storage_of(t)[0] for t in inputs}
    packed: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.add(storage_of(t)[0])
        return t

    live = LiveBytes()
    before = comm.traffic.copy() if comm is not None else Traffic()
    if comm is not None:
        comm.on_receive = lambda buf: live.retag(buf, "halo")
    with live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(x)
            if loss is not None:
                out = loss(out)
        forward_peak, after_forward = live.peak, live.current
        halo_kept = live.by_tag().get("halo", 0)
        outs = [t for t in as_items(out) if isinstance(t, torch.Tensor)]
        output_ids = {storage_of(t)[0] for t in outs}
        output_bytes = _nbytes([t for t in outs if live.owns(t)])
        middle = comm.traffic.copy() if comm is not None else Traffic()
        live.tag = "backward"
        live.reset_peak()
        _backward(out)
        backward_peak = live.peak
        input_grad_bytes = _nbytes([t.grad for t in inputs if t.grad is not None])
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        grad_bytes = _nbytes(grads)
        del out, outs
        for t in inputs:
            t.grad = None
        remaining = live.by_tag()
        from_backward = max(0, remaining.pop("backward", 0) - grad_bytes)
        from_forward = sum(remaining.values())
    if comm is not None:
        comm.on_receive = None
    after = comm.traffic.copy() if comm is not None else Traffic()
    return LayerFootprint(
        input_bytes=_nbytes(inputs), output_bytes=output_bytes, forward_peak=forward_peak,
        kept=after_forward - output_bytes - from_forward, halo_kept=halo_kept,
        saves_input=bool(input_ids & packed), saves_output=bool(output_ids & packed),
        backward_peak=backward_peak - from_forward - from_backward, input_grad_bytes=input_grad_bytes,
        grad_bytes=grad_bytes, persistent=from_forward + from_backward, forward_traffic=middle.minus(before),
        backward_traffic=after.minus(middle),
        gathered=tuple(comm.gathered) if comm is not None else ())


class FootprintCache:
    """Layer footprints by (structure, input shapes, dtype, role, loss): each simulated once."""

    def __init__(self) -> None:
        self._found: dict[Hashable, list[LayerFootprint]] = {}
        self._keys: dict[int, Hashable] = {}
        self.simulated = 0

    def _structure(self, layer: nn.Module) -> Hashable:
        key = self._keys.get(id(layer))
        if key is None:
            key = structure_key(layer)
            self._keys[id(layer)] = key
        return key

    def layer(self, layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
              loss: Loss | None = None, loss_key: Hashable = None,
              elementwise: Sequence[type] = ()) -> list[LayerFootprint]:
        """Footprint of ``layer`` on inputs ``shapes`` (whole maps), one per tile of ``role``."""
        key = (self._structure(layer), tuple(tuple(s) for s in shapes), dtype, role,
               loss_key if loss is not None else None, tuple(elementwise))
        found = self._found.get(key)
        if found is None:
            found = simulate_layer(layer, shapes, dtype, role, loss, elementwise)
            self._found[key] = found
            self.simulated += 1
        return found


def simulate_layer(layer: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype, role: StageRole,
                   loss: Loss | None = None, elementwise: Sequence[type] = ()) -> list[LayerFootprint]:
    """Footprint of ``layer`` per tile of ``role`` (one for whole maps); inputs are whole maps."""
    if role.grid is None:
        return [_simulate(meta_copy(layer, dtype), shapes, dtype, None, loss)]
    from ...spatial.convert import spatialize

    grid = TileGrid(*role.grid)
    world = FakeWorld(grid.num_tiles)
    group = Group(tuple(range(grid.num_tiles)))
    full = next((s for s in shapes if len(s) == 4), None)
    if full is None:
        raise ValueError(f"{type(layer).__name__}: a spatial stage needs 4-d (N, C, H, W) inputs")

    def tile(rank: int) -> LayerFootprint:
        comm = world.comm(rank)
        module = spatialize(nn.Sequential(meta_copy(layer, dtype)), grid, comm, group,
                            image_size=(full[-2], full[-1]), halo_d2=role.halo_d2,
                            fused_layers=role.fused_layers, elementwise=tuple(elementwise))
        return _simulate(module, tile_shapes(shapes, grid, rank), dtype, comm, loss)

    return run_ranks(world, tile)


# ------------------------------------------------------------------ composition
def compose_stage(layers: Sequence[LayerFootprint], grad_held: bool = False) -> StageFootprint:
    """One chunk of a stage from its layers' footprints (see the module docstring).

    ``grad_held``: the output gradient is a received buffer the runtime keeps for the
    whole backward of the stage (every stage but the last), not one freed once used.
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
        if grad_held and k < count - 1:
            own += layers[-1].output_bytes
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
        persistent=sum(fp.persistent for fp in layers), layers=tuple(layers))
