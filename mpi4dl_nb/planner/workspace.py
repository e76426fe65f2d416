"""Convolution workspace a backend allocates inside a conv, which ``meta`` misses, per rule (docs/planner-models.md)."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..config import Choice
from .live_bytes import LiveBytes

ONEDNN_MIN_ELEMENTS = 20480   # a single sample's input up to this size takes the im2col path
ONEDNN_TYPES = (torch.float32, torch.bfloat16, torch.float16)


class Workspace(Choice):
    """Which backend's convolution scratch memory the simulation adds."""

    CPU = "cpu"
    NONE = "none"

    @classmethod
    def for_device(cls, device: torch.device | str) -> Workspace:
        return cls.CPU if torch.device(device).type == "cpu" else cls.NONE


def channel_block(capability: str | None = None) -> int:
    """Channels per block of oneDNN's blocked layout on this CPU (``capability``: what
    ``torch.backends.cpu.get_cpu_capability()`` reports; None: ask it)."""
    found = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    return 16 if found.upper().startswith(("AVX512", "AMX")) else 8


def _one_by_one(conv: nn.Conv2d) -> bool:
    padding = conv.padding if isinstance(conv.padding, tuple) else (0, 0)
    return (tuple(conv.kernel_size) == (1, 1) and tuple(conv.stride) == (1, 1)
            and tuple(padding) == (0, 0))


def _onednn(conv: nn.Conv2d, x: torch.Tensor, samples: int) -> bool:
    """Whether PyTorch's CPU dispatch sends this (not 1x1 stride 1) conv to oneDNN."""
    if x.dtype not in ONEDNN_TYPES:
        return False
    kh, kw = conv.kernel_size
    return (samples > 1 or conv.groups > 1 or (kh > 3 and kw > 3)
            or samples * x[0].numel() > ONEDNN_MIN_ELEMENTS)


def channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` is a 4-d map laid out channels-last and not also contiguous (a 1-channel or 1x1 map is both)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


@functools.cache
def depthwise_weight_copies() -> int:
    """How many weight-sized partial gradients oneDNN's channels-last depthwise backward (kernel > 3)
    holds beside its reordered weight, measured once in this process on a 7x7 probe conv (first asked
    for by ``instrument``, before a simulation's meta tensors and dispatch modes exist)."""
    from ..measure.steps import measure_peak_bytes

    conv = nn.Conv2d(32, 32, 7, padding=3, groups=32)
    x = torch.zeros(2, 32, 16, 16).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    out = conv(x)
    grad = torch.ones_like(out)
    _, peak = measure_peak_bytes(lambda: out.backward(grad))
    weight = conv.weight.numel() * conv.weight.element_size()
    return max(0, round((peak - x.numel() * x.element_size()) / weight) - 1)


def _large_depthwise(conv: nn.Conv2d) -> bool:
    kh, kw = conv.kernel_size
    return conv.groups == conv.in_channels == conv.out_channels and kh > 3 and kw > 3


class ConvScratch(NamedTuple):
    """A conv's scratch bytes in its forward and its backward, and how many of each do not grow
    with the batch (reordered weights, partial weight gradients): kept as they are when a one-sample
    simulation is scaled to a chunk (``LayerFootprint.times``)."""

    forward: int
    backward: int
    forward_fixed: int = 0
    backward_fixed: int = 0


def conv_workspace(conv: nn.Conv2d, x: torch.Tensor, out: torch.Tensor, kind: Workspace,
                   samples: int | None = None) -> ConvScratch:
    """The scratch of ``conv`` on input ``x`` giving ``out`` (the backward's counts the input's size
    again when ``x`` needs a gradient, see the module docstring); ``samples``: the chunk size the
    backend sees (None: ``x``'s; the simulation runs one sample)."""
    if kind is Workspace.NONE or _one_by_one(conv):
        return ConvScratch(0, 0)
    size = x.element_size()
    again = x.numel() * size if x.requires_grad else 0
    weight = conv.weight.numel() * size
    if channels_last(x) and x.dtype in ONEDNN_TYPES:
        fixed = weight * (1 + (depthwise_weight_copies() if _large_depthwise(conv) else 0))
        return ConvScratch(weight, fixed + again, weight, fixed)
    if _onednn(conv, x, x.shape[0] if samples is None else samples):
        channels = x.shape[1]
        block = channel_block()
        padded = x.numel() // channels * math.ceil(channels / block) * block * size
        return ConvScratch(padded + weight, padded + x.numel() * size + again, weight)
    columns = (out.shape[0] * conv.in_channels // conv.groups * math.prod(conv.kernel_size)
               * out.shape[-2] * out.shape[-1] * size)
    return ConvScratch(columns, columns + again)


@dataclass
class SplitPhase:
    """A split backward's simulation on this thread: whether its I runs (``input_only``: a conv whose input
    needs no gradient runs no backward) or its W (``weight_only``: no input gradient anywhere)."""

    input_only: bool = False
    weight_only: bool = False


_SPLIT = threading.local()


@contextmanager
def split_phase() -> Iterator[SplitPhase]:
    """Simulate a split backward on this thread (see the module docstring)."""
    phase = SplitPhase()
    _SPLIT.phase = phase
    try:
        yield phase
    finally:
        _SPLIT.phase = None


def _allocate(nbytes: int, fixed: int, device: torch.device) -> None:
    """A short-lived allocation of ``nbytes``, ``fixed`` of them marked as not growing with the batch."""
    grows = torch.empty(nbytes - fixed, dtype=torch.uint8, device=device)
    stays = torch.empty(fixed, dtype=torch.uint8, device=device)
    live = LiveBytes.active()
    if live is not None and fixed:
        live.mark_fixed(stays)
    del grows, stays


def instrument(module: nn.Module, kind: Workspace, samples: int | None = None) -> list[RemovableHandle]:
    """Hooks adding each conv's scratch (for chunks of ``samples``, see ``conv_workspace``) to the
    memory alive during its forward (next to its output) and its backward (next to its output
    gradient and input gradient)."""
    if kind is Workspace.NONE:
        return []
    if any(isinstance(m, nn.Conv2d) and _large_depthwise(m) for m in module.modules()):
        depthwise_weight_copies()          # measured now, outside the simulation that will ask for it

    def hook(conv: nn.Conv2d, args: tuple[object, ...], out: object) -> None:
        if not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
            return
        scratch = conv_workspace(conv, args[0], out, kind, samples)
        if scratch.forward:
            _allocate(scratch.forward, scratch.forward_fixed, out.device)
        phase: SplitPhase | None = getattr(_SPLIT, "phase", None)
        needs_input = args[0].requires_grad
        again = args[0].numel() * args[0].element_size() if needs_input else 0
        if scratch.backward and out.requires_grad:
            def at_backward(grad: torch.Tensor) -> None:
                if phase is None:
                    _allocate(scratch.backward, scratch.backward_fixed, grad.device)
                elif phase.weight_only:    # W: the weight gradient's part, no input gradient
                    _allocate(scratch.backward - again, scratch.backward_fixed, grad.device)
                elif needs_input or not phase.input_only:
                    _allocate(scratch.backward, scratch.backward_fixed, grad.device)
            out.register_hook(at_backward)

    def norm_hook(norm: nn.modules.batchnorm._BatchNorm, args: tuple[object, ...], out: object) -> None:
        if not (norm.training and isinstance(out, torch.Tensor) and out.requires_grad and args
                and isinstance(args[0], torch.Tensor) and args[0].requires_grad):
            return
        temporary = 2 * args[0].numel() * args[0].element_size()   # the temporary + the input gradient
        phase: SplitPhase | None = getattr(_SPLIT, "phase", None)

        def at_backward(grad: torch.Tensor) -> None:
            weight_only = phase is not None and phase.weight_only   # a split backward's W: no input gradient
            scratch = torch.empty(temporary // 2 if weight_only else temporary, dtype=torch.uint8, device=grad.device)
            del scratch
        out.register_hook(at_backward)

    hooks = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, nn.Conv2d)]
    return hooks + [m.register_forward_hook(norm_hook) for m in module.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm)]
