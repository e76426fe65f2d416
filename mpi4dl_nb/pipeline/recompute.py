"""Activation recomputation: a stage keeps only its segments' inputs and recomputes inside on backward.

``checkpointed(module, setting)`` cuts a stage into segments ('every': one layer each; 'blocks': ``ceil(sqrt(L))``
layers each; N: N layers each). Exact: the recomputed forward sends nothing (the first forward's halo strips and
BatchNorm statistics are kept, ``spatial/replay.py``), updates no running statistics, and restores the RNG and
autocast states (docs/engine.md, Recomputation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..comm.messages import Payload, as_items
from ..config import CheckpointGranularity, CheckpointSetting
from ..spatial.function_ctx import FunctionContext
from ..spatial.layer import ForwardState, SpatialRuntime, shallow_copy
from ..spatial.replay import ForwardLog
from ..spatial.tile_layout import TileLayout
from ..spatial.tile_marks import is_tiled, layout_of, mark_tiled
from .bn_replay import RunningStatsNorm, running_stat_norms


def segment_bounds(num_layers: int, setting: CheckpointSetting) -> list[tuple[int, int]]:
    """Half-open layer ranges of the segments of a stage of ``num_layers`` layers.

    >>> segment_bounds(5, 2)
    [(0, 2), (2, 4), (4, 5)]
    >>> segment_bounds(9, "blocks")
    [(0, 3), (3, 6), (6, 9)]
    """
    if setting == CheckpointGranularity.EVERY:   # == (not is): the strings 'every'/'blocks' work too
        size = 1
    elif setting == CheckpointGranularity.BLOCKS:
        size = max(1, math.ceil(math.sqrt(num_layers)))
    elif isinstance(setting, int) and setting >= 1:
        size = setting
    else:
        raise ValueError(f"checkpoint setting {setting!r}: use 'every', 'blocks' or N >= 1")
    return [(start, min(start + size, num_layers)) for start in range(0, num_layers, size)]


@contextmanager
def spare_running_stats(norms: Sequence[RunningStatsNorm]) -> Iterator[None]:
    """Inside, ``norms`` update throw-away copies of their running statistics (restored after)."""
    saved = [(m, m.running_mean, m.running_var, getattr(m, "num_batches_tracked", None)) for m in norms]
    try:
        for m, mean, var, tracked in saved:
            m.running_mean, m.running_var = mean.clone(), var.clone()
            if isinstance(tracked, torch.Tensor):
                m.num_batches_tracked = tracked.clone()
        yield
    finally:
        for m, mean, var, tracked in saved:
            m.running_mean, m.running_var = mean, var
            if isinstance(tracked, torch.Tensor):
                m.num_batches_tracked = tracked


@dataclass
class _Replay:
    """What a segment's recomputation needs to repeat its first forward exactly."""

    run: Callable[[Payload], Payload]
    norms: list[RunningStatsNorm]
    runtime: SpatialRuntime | None
    spatial_state: ForwardState | None
    tuple_payload: bool
    tiled_inputs: list[TileLayout | None]    # each input's tile layout (None: not a tile)
    tiled_outputs: list[TileLayout | None]
    rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    device: torch.device
    autocast: tuple[bool, torch.dtype]
    received: ForwardLog

    @contextmanager
    def again(self, inputs: list[torch.Tensor]) -> Iterator[None]:
        """The context of the recomputed forward (grad on, same RNG/autocast/placements)."""
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[self.device] if self.cuda_rng is not None else []))
            torch.set_rng_state(self.rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            stack.enter_context(torch.enable_grad())
            enabled, dtype = self.autocast
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype, enabled=enabled))
            stack.enter_context(spare_running_stats(self.norms))
            if self.runtime is not None and self.spatial_state is not None:
                tiles = tuple(t for t, layout in zip(inputs, self.tiled_inputs) if layout is not None)
                stack.enter_context(self.runtime.replaying(self.spatial_state, tiles))
                _mark(inputs, self.tiled_inputs)    # their own layouts again (a ViT's token tiles)
                stack.enter_context(self.received.replaying_entries())
            yield


def _payload(replay: _Replay, items: list[torch.Tensor]) -> Payload:
    return tuple(items) if replay.tuple_payload else items[0]


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    kind = device.type if device.type in ("cuda", "cpu") else "cpu"
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


class _RecomputeCtx(FunctionContext, Protocol):
    replay: _Replay
    inputs: int      # how many of the saved tensors are the segment's inputs
    single: bool     # whether the segment returned one tensor (else a tuple)


class _Recompute(torch.autograd.Function):
    """A segment run without a graph; backward recomputes it with one and back-propagates."""

    @staticmethod
    def forward(fctx: _RecomputeCtx, replay: _Replay, anchor: torch.Tensor, *inputs: torch.Tensor) -> Payload:
        with replay.received.recording():
            out = replay.run(_payload(replay, list(inputs)))
        items = as_items(out)
        replay.tiled_outputs = _layouts(items)
        fctx.replay = replay
        fctx.inputs = len(inputs)
        # the received halo strips and statistics are held until backward: saved, so counted
        kept = [t for entry in replay.received.entries for t in entry if isinstance(t, torch.Tensor)]
        fctx.save_for_backward(*inputs, *kept)
        fctx.mark_non_differentiable(*[t for t in items if not t.is_floating_point()])
        fctx.single = isinstance(out, torch.Tensor)
        return out if fctx.single else tuple(items)

    @staticmethod
    def backward(fctx: _RecomputeCtx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        replay: _Replay = fctx.replay
        inputs = [t.detach().requires_grad_(t.is_floating_point() and needs)
                  for t, needs in zip(fctx.saved_tensors[:fctx.inputs], fctx.needs_input_grad[2:])]
        _mark(inputs, replay.tiled_inputs)
        with replay.again(inputs):
            out = replay.run(_payload(replay, inputs))
        pairs = [(o, g) for o, g in zip(as_items(out), grads)
                 if g is not None and o.is_floating_point() and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])


def run_recomputed(run: Callable[[Payload], Payload], x: Payload, norms: list[RunningStatsNorm],
                   runtime: SpatialRuntime | None) -> Payload:
    """``run(x)`` keeping only ``x`` for backward (``run`` is recomputed there)."""
    inputs = as_items(x)
    device = inputs[0].device if inputs else torch.device("cpu")
    replay = _Replay(run=run, norms=norms, runtime=runtime,
                     spatial_state=runtime.forward_state() if runtime is not None else None,
                     tuple_payload=isinstance(x, (tuple, list)),
                     tiled_inputs=_layouts(inputs), tiled_outputs=[],
                     rng=torch.get_rng_state(),
                     cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                     device=device, autocast=_autocast_state(device), received=ForwardLog())
    # an anchor that requires grad: backward runs (parameter gradients) even when no input needs one
    anchor = torch.empty(0, device=device, requires_grad=True)
    out = _Recompute.apply(replay, anchor, *inputs)
    items = [out] if isinstance(out, torch.Tensor) else list(out)
    _mark(items, replay.tiled_outputs)
    return out if isinstance(out, torch.Tensor) else tuple(items)


def _layouts(tensors: Sequence[torch.Tensor]) -> list[TileLayout | None]:
    """Each tensor's tile layout (None: not a tile)."""
    return [layout_of(t) if is_tiled(t) else None for t in tensors]


def _mark(tensors: Sequence[torch.Tensor], layouts: Sequence[TileLayout | None]) -> None:
    """Mark the tensors that were tiles with the layouts they had."""
    for t, layout in zip(tensors, layouts):
        if layout is not None:
            mark_tiled(t, layout)


class RecomputedSequential(nn.Sequential):
    """An ``nn.Sequential`` (same children, hooks and state) run segment by segment with recomputation."""

    segments: list[tuple[int, int]]
    recompute_runtime: SpatialRuntime | None

    def forward(self, x: Payload) -> Payload:
        layers = list(self)
        for start, stop in self.segments:
            segment = layers[start:stop]

            def run(value: Payload, segment: list[nn.Module] = segment) -> Payload:
                for layer in segment:
                    value = layer(value)
                return value

            if not torch.is_grad_enabled():
                x = run(x)
                continue
            norms = [m for layer in segment for m in running_stat_norms(layer)]
            x = run_recomputed(run, x, norms, self.recompute_runtime)
        return x


def checkpointed(module: nn.Module, setting: CheckpointSetting, runtime: SpatialRuntime | None = None) -> nn.Module:
    """``module`` (an nn.Sequential of layers) run with activation recomputation.

    A shallow copy sharing children, parameters, buffers and hooks (a spatialized stage's
    root hooks included; pass its ``runtime``); the module itself is left as it was.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"activation recomputation needs an nn.Sequential stage, got {type(module).__name__}")
    new = shallow_copy(module, RecomputedSequential)
    object.__setattr__(new, "segments", segment_bounds(len(module), setting))
    object.__setattr__(new, "recompute_runtime", runtime)
    return new
