"""Split backward of a stage copy: I (input gradient; layer output gradients kept) now, W (parameter gradients) later.

A forward under :class:`LayerRecorder` notes, for every module that owns parameters directly (a
"layer"), the gradient edges of its outputs (taken before any later in-place op rebases them).
:func:`input_backward` then runs one ``torch.autograd.grad`` from the stage output to the stage
input and to those edges (``retain_graph``): the previous stage gets its gradient, and each layer's
output gradient is kept. :meth:`WeightWork.run` computes each layer's parameter gradients from its
own output edge and output gradient: the autograd engine runs only the nodes between the layer's
output and its parameters (a convolution's weight gradient from its saved input), nothing upstream.

Exact: the gradient reaching a layer's output is the same sum in both, and a parameter used only
inside one call of its layer gets all its gradient through that output. A layer called more
than once in a forward (a shared module) is not split: its parameters get their gradients in I,
in the same ``torch.autograd.grad`` call (correct, it only fills less of the bubble).

Which stages split: ``splits_backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.hooks import RemovableHandle

from ..comm.messages import as_items
from ..spatial.backward_half import weight_half

if TYPE_CHECKING:
    from ..config import ParallelConfig


def splits_backward(cfg: ParallelConfig, stage: int) -> bool:
    """Whether the engine computes ``stage``'s I and W apart (else its I runs the whole backward, its W nothing).

    Under a zero-bubble schedule, but not on the first stage: its input, the images, needs no gradient, so no
    rank waits for its I, and its W follows its I in every schedule built here; split, it would only repeat work
    (the norms' reductions in W, one autograd call per layer): measured at 1.5x one backward on the 4 conv-BN-ReLU
    layers of bench_pipeline's first stage. torch.distributed.pipelining does not split its first stage either.
    Nor with recomputation (the graph is rebuilt inside the backward) or synchronised BatchNorm."""
    return (stage > 0 and cfg.schedule.splits_backward and cfg.checkpoint_activations is None
            and not cfg.sync_batchnorm)


@dataclass(slots=True)
class LayerCall:
    """One layer's forward of a micro-batch: its own parameters and its outputs' gradient edges."""

    module: nn.Module
    params: tuple[nn.Parameter, ...]
    edges: list[GradientEdge] = field(default_factory=list)
    calls: int = 0


@dataclass
class WeightWork:
    """The deferred W of one micro-batch on one stage copy: per layer, its output edges and their gradients."""

    layers: list[tuple[LayerCall, list[torch.Tensor | None]]]

    def run(self) -> None:
        """Add each layer's parameter gradients to ``.grad`` (nothing exchanged: only local autograd nodes run)."""
        with weight_half():
            self._run()
        self.layers.clear()

    def _run(self) -> None:
        for layer, grads in self.layers:
            pairs = [(edge, grad) for edge, grad in zip(layer.edges, grads) if grad is not None]
            if not pairs:
                continue
            found = torch.autograd.grad([e for e, _ in pairs], layer.params, [g for _, g in pairs],
                                        retain_graph=True, allow_unused=True)
            accumulate(layer.params, found)


def accumulate(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    """``p.grad += g`` for each parameter that got a gradient (set when it has none yet)."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g.detach()
        else:
            p.grad.add_(g)


class LayerRecorder:
    """Records the layers' calls of forwards run inside :meth:`recording` (one forward hook per layer).

    ``persistent``: the hooks stay from construction to ``close()`` and pass every forward outside
    ``recording`` (an evaluation) through untouched - what the runtime uses, so a forward registers nothing;
    else they are registered for each ``recording`` and removed after it."""

    def __init__(self, module: nn.Module, persistent: bool = False) -> None:
        self.layers = [m for m in module.modules()
                       if any(p.requires_grad for p in m.parameters(recurse=False))]
        self.params = [tuple(p for p in m.parameters(recurse=False) if p.requires_grad) for m in self.layers]
        self.persistent = persistent
        self._calls: list[LayerCall] | None = None
        self._handles: list[RemovableHandle] = self._attach() if persistent else []

    def _attach(self) -> list[RemovableHandle]:
        return [m.register_forward_hook(self._hook_for(i)) for i, m in enumerate(self.layers)]

    def _hook_for(self, index: int) -> Callable[[nn.Module, object, object], None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            if self._calls is None:
                return
            call = self._calls[index]
            call.calls += 1
            if isinstance(output, torch.Tensor):    # the usual layer: one output, its edge without a list walk
                call.edges = [edge_of(output)] if output.grad_fn is not None else []
                return
            items = as_items(output) if isinstance(output, (tuple, list)) else []
            call.edges = [edge_of(t) for t in items if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        return hook

    def recording(self) -> _Recording:
        """``with recorder.recording() as calls``: the layers' calls of the forwards run inside (a plain context
        object, not a generator: it is entered once per forward)."""
        return _Recording(self)

    def _begin(self) -> list[LayerCall]:
        self._calls = [LayerCall(m, params) for m, params in zip(self.layers, self.params)]
        if not self.persistent:
            self._handles = self._attach()
        return self._calls

    def _end(self) -> None:
        self._calls = None
        if not self.persistent:
            self.close()

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _Recording:
    """A :class:`LayerRecorder`'s recording of the forwards run inside ``with``."""

    __slots__ = ("recorder",)

    def __init__(self, recorder: LayerRecorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> list[LayerCall]:
        return self.recorder._begin()

    def __exit__(self, *exc: object) -> None:
        self.recorder._end()


def edge_of(tensor: torch.Tensor) -> GradientEdge:
    """``get_gradient_edge`` of a tensor with a ``grad_fn``, without its checks for the common case (a C++ node: no
    ownership token needed; a Python ``autograd.Function``'s node still gets one)."""
    node = tensor.grad_fn
    if node is None or isinstance(node, torch._C._FunctionBase):
        return get_gradient_edge(tensor)
    return GradientEdge(node, tensor.output_nr)


def input_backward(calls: Sequence[LayerCall], outputs: Sequence[torch.Tensor],
                   grad_outputs: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: the gradients of ``inputs`` (the stage input's float tensors) and the deferred W.

    Layers called exactly once with a differentiable output are split (their output gradients kept for
    W); every other parameter gets its gradient here."""
    split = [c for c in calls if c.calls == 1 and c.edges]
    whole = [p for c in calls if not (c.calls == 1 and c.edges) for p in c.params]
    targets = [*map(get_gradient_edge, inputs), *(e for c in split for e in c.edges), *map(get_gradient_edge, whole)]
    if not outputs or not targets:   # nothing differentiable came out: no gradient anywhere
        return [None] * len(inputs), WeightWork([])
    found: list[torch.Tensor | None] = list(torch.autograd.grad(
        list(outputs), targets, list(grad_outputs), retain_graph=bool(split), allow_unused=True))
    input_grads, found = found[:len(inputs)], found[len(inputs):]
    layers: list[tuple[LayerCall, list[torch.Tensor | None]]] = []
    for call in split:
        layers.append((call, found[:len(call.edges)]))
        found = found[len(call.edges):]
    accumulate(whole, found)
    return input_grads, WeightWork(layers)
