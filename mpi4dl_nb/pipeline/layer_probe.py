"""What each layer of a list costs: its training memory (shape-only, the one counting rule) and its time.

``layer_memory`` is the counting rule the memory planner and ``default_cut.auto_balance(by="memory")`` share;
``probe_memory`` asks it shape-only at a probe size for the default cut (the last few models' answers kept);
``profile_layer_times`` times forward + backward for ``auto_balance(by="time")``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm.messages import Payload, as_items, like
from ..spatial.fit import meta_copy
from .layer_memo import LayerMemo

PROBE_SIZE = 256   # image side the default cut profiles memory at (shape-only, on meta)
PROBE_ERRORS = (RuntimeError, ValueError, TypeError, NotImplementedError)   # a layer that cannot run on meta


def first_layer_channels(layers: Sequence[nn.Module]) -> int | None:
    """The channels the first layer takes (its first module with ``in_channels``), or None."""
    for module in layers[0].modules() if layers else ():
        channels = getattr(module, "in_channels", None)
        if isinstance(channels, int):
            return channels
    return None


def parameter_dtype(layers: Sequence[nn.Module]) -> torch.dtype:
    """The element type of the first parameter (float32 if there is none)."""
    return next((p.dtype for layer in layers for p in layer.parameters()), torch.float32)


@dataclass(frozen=True)
class LayerMemory:
    """One layer's training memory under the counting rule of :func:`layer_memory` (bytes)."""

    saved_bytes: int                   # activations autograd keeps for backward
    param_bytes: int
    outputs: tuple[torch.Tensor, ...]  # the layer's output tensors (meta: shapes only)

    @property
    def total(self) -> int:
        return self.saved_bytes + self.param_bytes


Instrument = Callable[[int, nn.Module], Sequence[RemovableHandle]]


def layer_memory(layers: Sequence[nn.Module], sample: Payload, *,
                 dtype: torch.dtype | None = None,
                 instrument: Instrument | None = None) -> list[LayerMemory]:
    """Per layer of ``nn.Sequential(*layers)`` on ``sample``: bytes saved for backward and parameters.

    The counting rule (the one the planner and ``auto_balance(by="memory")`` share): a
    layer is charged the tensors autograd saves during its training-mode forward, each by
    its own size (elements x element size); parameters are not activations (they are
    ``param_bytes``), 0-d tensors are ignored, and a tensor saved by several layers (a ReLU
    output the next conv saves too) is charged once, to the first layer that saves it.

    Runs shape-only on ``meta`` copies of the layers (no memory, no data; the originals
    and their BatchNorm statistics are untouched), in ``dtype`` if given. Float inputs
    require grad, as in training. ``instrument(index, layer_copy)`` may register hooks on
    a copy before it runs (the planner counts FLOPs so) and returns their handles.
    """
    def to_meta(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t.detach().to(device="meta")
        return t.detach().to(device="meta", dtype=dtype or t.dtype).requires_grad_(True)

    x = like(sample, [to_meta(t) if isinstance(t, torch.Tensor) else t for t in as_items(sample)])
    seen: dict[int, torch.Tensor] = {}     # keeps counted tensors alive, so ids stay unique
    found = []
    for index, layer in enumerate(layers):
        meta_layer = meta_copy(layer)
        if dtype is not None:
            meta_layer.to(dtype=dtype)
        meta_layer.train()
        param_ids = {id(p) for p in meta_layer.parameters()}
        saved: list[int] = []

        def pack(t: torch.Tensor, param_ids: set[int] = param_ids, saved: list[int] = saved
                 ) -> torch.Tensor:
            if id(t) not in param_ids and id(t) not in seen and t.dim() > 0:
                seen[id(t)] = t
                saved.append(_nbytes(t))
            return t

        handles = instrument(index, meta_layer) if instrument is not None else ()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x = meta_layer(x)
        finally:
            for handle in handles:
                handle.remove()
        params = sum(_nbytes(p) for p in meta_layer.parameters())
        outputs = tuple(t for t in as_items(x) if isinstance(t, torch.Tensor))
        found.append(LayerMemory(sum(saved), params, outputs))
    return found


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# the memory probes of the last few models: the pre-flight check, the engine and the planner's cuts ask alike
_PROBED: LayerMemo[list[LayerMemory] | None] = LayerMemo()


def probe_memory(layers: Sequence[nn.Module], probe_size: int = PROBE_SIZE) -> list[LayerMemory] | None:
    """``layer_memory`` of ``layers`` on a square image (meta) of ``probe_size`` pixels a side, or of the side a
    model built for one size takes (``built_side``); None if the input channels cannot be told (no conv) or the
    layers fail at that size. The last few results are kept (for the same layer objects, unchanged)."""
    return _probed_once(layers, built_side(layers) or probe_size)


def built_side(layers: Sequence[nn.Module]) -> int | None:
    """The side of the square images a model built for one size takes (its first piece's ``built``: timm's Swin,
    MaxViT), which the memory probe must run at; None for a model that takes any size."""
    built = getattr(layers[0], "built", None) if layers else None
    if isinstance(built, tuple) and len(built) == 2 and built[0] == built[1] and isinstance(built[0], int):
        return built[0]
    return None


def _probed_once(layers: Sequence[nn.Module], side: int) -> list[LayerMemory] | None:
    return _PROBED.get(layers, side, lambda: _probed_memory(layers, side))


def _probed_memory(layers: Sequence[nn.Module], side: int) -> list[LayerMemory] | None:
    channels = first_layer_channels(layers)
    if channels is None:
        return None
    sample = torch.empty(1, channels, side, side, dtype=parameter_dtype(layers), device="meta")
    try:
        return layer_memory(layers, sample)
    except PROBE_ERRORS:
        return None


def profile_layer_memory(layers: Sequence[nn.Module], sample: Payload) -> list[int]:
    """Bytes per layer on ``sample``: saved activations + parameters, by :func:`layer_memory`'s rule."""
    return [m.total for m in layer_memory(layers, sample)]


def profile_layer_times(layers: Sequence[nn.Module], sample: Payload, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward per layer on ``sample`` (median of ``repeats``).

    Runs on copies of the layers, so their BatchNorm statistics and gradients stay untouched.
    """
    layers = [copy.deepcopy(layer) for layer in layers]
    times: list[float] = []
    x = sample
    for layer in layers:
        runs = []
        for _ in range(max(1, repeats)):
            inp = _detach_input(x)
            start = time.perf_counter()
            out = layer(inp)
            _backward_all(out)
            runs.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        times.append(sorted(runs)[len(runs) // 2])
        with torch.no_grad():
            x = layer(_detach_input(x))
    return times


def _detach_input(value: Payload) -> Payload:
    """``value`` with each float tensor a fresh leaf that requires grad (others as they are)."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(True) if t.is_floating_point() else t
    return like(value, [leaf(t) if isinstance(t, torch.Tensor) else t for t in as_items(value)])


def _backward_all(output: Payload) -> None:
    outs = [t for t in as_items(output) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
