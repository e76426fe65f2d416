"""One module's forward and backward run on the ``meta`` device under ``LiveBytes``, counted: a ``LayerFootprint``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..comm.messages import Payload, as_items
from ..pipeline.split_backward import LayerRecorder, input_backward
from .fake_world import FakeComm, Traffic
from .footprint import LayerFootprint, Loss, Shape, SplitRun, SplitTerms
from .layouts import BackendLayouts
from .live_bytes import LiveBytes, storage_of
from .workspace import Workspace, instrument, split_phase


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


def count_module(module: nn.Module, shapes: Sequence[Shape], dtype: torch.dtype,
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
    """``count_module``'s count, the backend's hooks in place: the forward's and the backward's live bytes, what
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
