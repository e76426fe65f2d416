"""Layer profiles: each layer's shapes, parameters, saved bytes and FLOPs at batch 1, on ``meta``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..measure.usage import tensor_bytes
from ..pipeline.layer_probe import layer_memory
from .layouts import BackendLayouts
from .workspace import channels_last

Layers = Sequence[nn.Module] | nn.Sequential
Shape = tuple[int, ...]
Windowed = nn.modules.conv._ConvNd | nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd   # has a window


@dataclass(frozen=True)
class LayerProfile:
    """One layer at batch 1 on the full image: shapes, bytes saved for backward, cost.

    ``layer`` is the profiled module itself (the memory model simulates it).
    """

    index: int
    name: str
    out_shapes: tuple[Shape, ...]
    param_bytes: int
    saved_bytes: int          # per sample, activations only (parameters excluded)
    out_bytes: int            # per sample
    flops: float              # per sample, forward multiply-adds x 2 (convs, linears) + elementwise
    spatial_dims: tuple[int, int] | None   # output (H, W) if the output is a feature map
    window_in_bytes: int = 0  # per sample, inputs of convs/pools with a window > 1
    in_shapes: tuple[Shape, ...] = ()
    in_dtypes: tuple[torch.dtype, ...] = ()
    in_channels_last: tuple[bool, ...] = ()   # per input: laid out channels-last (e.g. after a permute back)
    param_count: int = 0
    buffer_bytes: int = 0
    layer: nn.Module | None = field(default=None, compare=False, repr=False)

    @property
    def output_is_map(self) -> bool:
        """Whether every output is a 4-d feature map (a spatial stage may end here)."""
        return bool(self.out_shapes) and all(len(s) == 4 for s in self.out_shapes)


def as_layer_list(model: Layers) -> list[nn.Module]:
    """The layers of ``model`` (a list of modules or an nn.Sequential); ValueError otherwise."""
    if isinstance(model, nn.Sequential):
        return list(model.children())
    layers = list(model)
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise ValueError("model must be a non-empty list of nn.Module layers (or nn.Sequential)")
    return layers


def _tensors(value: object) -> list[torch.Tensor]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _flop_hooks(model: nn.Module, counter: list[float]) -> list[RemovableHandle]:
    """Hooks adding ``model``'s forward FLOPs to ``counter[0]`` and the bytes of the inputs
    of its windowed convs/pools (window > 1) to ``counter[1]``."""
    def conv_hook(module: nn.modules.conv._ConvNd, inputs: tuple[object, ...], output: torch.Tensor) -> None:
        k = math.prod(module.kernel_size) * module.in_channels // module.groups
        counter[0] += 2.0 * output.numel() * k

    def linear_hook(module: nn.Linear, inputs: tuple[object, ...], output: torch.Tensor) -> None:
        counter[0] += 2.0 * output.numel() * module.in_features

    def other_hook(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        if not list(module.children()):
            counter[0] += float(sum(t.numel() for t in _tensors(output)))

    def window_hook(module: Windowed, inputs: tuple[object, ...], output: object) -> None:
        kernel = module.kernel_size if isinstance(module.kernel_size, tuple) else (module.kernel_size,)
        if any(isinstance(k, int) and k > 1 for k in kernel):
            counter[1] += float(sum(tensor_bytes(t) for t in _tensors(inputs)))

    handles = []
    for sub in model.modules():
        if isinstance(sub, (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd,
                            nn.modules.pooling._AvgPoolNd)):
            handles.append(sub.register_forward_hook(window_hook))
        if isinstance(sub, nn.modules.conv._ConvNd):
            handles.append(sub.register_forward_hook(conv_hook))
        elif isinstance(sub, nn.Linear):
            handles.append(sub.register_forward_hook(linear_hook))
        else:
            handles.append(sub.register_forward_hook(other_hook))
    return handles


def profile_layers(model: Layers, image_size: int | tuple[int, int], in_channels: int = 3,
                   dtype: torch.dtype = torch.float32) -> list[LayerProfile]:
    """Per-layer shapes, saved-for-backward bytes and FLOPs at batch 1 (on the meta device).

    Saved bytes follow ``pipeline.layer_probe.layer_memory``'s counting rule (shared with
    ``auto_balance(by="memory")``): parameters excluded, a tensor saved by two layers (a
    ReLU output that the next conv also saves) counted once, for the first layer that saved it.
    """
    layers = as_layer_list(model)
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    sample = torch.empty(1, in_channels, height, width, device="meta", dtype=dtype)
    counters = [[0.0, 0.0] for _ in layers]      # per layer: FLOPs, windowed-input bytes
    with BackendLayouts():   # each layer's input laid out as on the ranks (channels-last after a permute back)
        memory = layer_memory(layers, sample, dtype=dtype,
                              instrument=lambda index, layer: _flop_hooks(layer, counters[index]))
    profiles = []
    previous: tuple[torch.Tensor, ...] = (sample,)
    for index, (layer, mem, (flops, window_in)) in enumerate(zip(layers, memory, counters)):
        first = mem.outputs[0] if mem.outputs else None
        dims = (int(first.shape[-2]), int(first.shape[-1])) if first is not None and first.dim() == 4 \
            else None
        profiles.append(LayerProfile(
            index, type(layer).__name__, tuple(tuple(t.shape) for t in mem.outputs),
            mem.param_bytes, mem.saved_bytes, sum(tensor_bytes(t) for t in mem.outputs), flops, dims,
            int(window_in), in_shapes=tuple(tuple(t.shape) for t in previous),
            in_dtypes=tuple(t.dtype for t in previous), in_channels_last=tuple(map(channels_last, previous)),
            param_count=sum(p.numel() for p in layer.parameters()),
            buffer_bytes=sum(tensor_bytes(b) for b in layer.buffers()), layer=layer))
        previous = mem.outputs
    return profiles


def batched(shape: Shape, batch: int) -> Shape:
    """``shape`` (batch 1) with its leading dimension set to ``batch``."""
    return (batch, *shape[1:]) if shape else shape
