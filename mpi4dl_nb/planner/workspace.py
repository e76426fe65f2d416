"""Convolution workspace: the scratch memory a backend allocates inside a conv, which ``meta``
(shapes only) does not see. Added to the simulation as a short-lived allocation in each
conv's forward and backward, by an explicit rule per backend (measured on AVX2 and AVX-512
machines, torch 2.13 CPU, see tests/planner/test_planner*.py):

* ``Workspace.CPU``: float32 (and 16-bit) convs other than 1x1 stride 1 run through oneDNN, which
  reorders the input into a channel-blocked copy (channels padded to a multiple of the block
  its kernels use: 16 where PyTorch runs AVX-512 code, 8 on AVX2 machines) in the forward,
  plus the input's size again in the backward - when PyTorch's CPU dispatch picks oneDNN: a
  batch of 2 or more, a grouped conv, a kernel larger than 3 both ways, or an input of more
  than 20480 elements; other float32 convs (one small sample, e.g. a stem on a 64 px
  micro-batch of 1) and other dtypes (float64) take PyTorch's own im2col path: a column
  buffer of ``C_in * kh * kw * H_out * W_out`` elements per sample in the forward and again
  in the backward, unless the conv is 1x1 with stride 1 and no padding.
  A training-mode BatchNorm's backward allocates an input-sized temporary next to its input
  gradient (when the input needs one).
* ``Workspace.NONE``: nothing (e.g. CUDA, whose cuDNN workspace depends on the algorithm
  chosen at run time and is not modelled).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..config import Choice

ONEDNN_MIN_ELEMENTS = 20480   # a single sample's input up to this size takes the im2col path


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
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    kh, kw = conv.kernel_size
    return (samples > 1 or conv.groups > 1 or (kh > 3 and kw > 3)
            or samples * x[0].numel() > ONEDNN_MIN_ELEMENTS)


def conv_workspace(conv: nn.Conv2d, x: torch.Tensor, out: torch.Tensor, kind: Workspace,
                   samples: int | None = None) -> tuple[int, int]:
    """(forward, backward) scratch bytes of ``conv`` on input ``x`` giving ``out``; ``samples``:
    the chunk size the backend sees (None: ``x``'s; the simulation runs one sample)."""
    if kind is Workspace.NONE or _one_by_one(conv):
        return (0, 0)
    size = x.element_size()
    if _onednn(conv, x, x.shape[0] if samples is None else samples):
        channels = x.shape[1]
        block = channel_block()
        padded = x.numel() // channels * math.ceil(channels / block) * block * size
        weight = conv.weight.numel() * size
        return (padded + weight, padded + x.numel() * size)
    columns = (out.shape[0] * conv.in_channels // conv.groups * math.prod(conv.kernel_size)
               * out.shape[-2] * out.shape[-1] * size)
    return (columns, columns)


def instrument(module: nn.Module, kind: Workspace, samples: int | None = None) -> list[RemovableHandle]:
    """Hooks adding each conv's scratch (for chunks of ``samples``, see ``conv_workspace``) to the
    memory alive during its forward (next to its output) and its backward (next to its output
    gradient and input gradient)."""
    if kind is Workspace.NONE:
        return []

    def hook(conv: nn.Conv2d, args: tuple[object, ...], out: object) -> None:
        if not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
            return
        x = args[0]
        forward, backward = conv_workspace(conv, x, out, kind, samples)
        if forward:
            del_soon = torch.empty(forward, dtype=torch.uint8, device=out.device)
            del del_soon
        if backward and out.requires_grad:
            input_bytes = x.numel() * x.element_size() if x.requires_grad else 0

            def at_backward(grad: torch.Tensor) -> None:
                scratch = torch.empty(backward + input_bytes, dtype=torch.uint8, device=grad.device)
                del scratch
            out.register_hook(at_backward)

    def norm_hook(norm: nn.modules.batchnorm._BatchNorm, args: tuple[object, ...], out: object) -> None:
        if not (norm.training and isinstance(out, torch.Tensor) and out.requires_grad and args
                and isinstance(args[0], torch.Tensor) and args[0].requires_grad):
            return
        temporary = 2 * args[0].numel() * args[0].element_size()   # the temporary + the input gradient

        def at_backward(grad: torch.Tensor) -> None:
            scratch = torch.empty(temporary, dtype=torch.uint8, device=grad.device)
            del scratch
        out.register_hook(at_backward)

    hooks = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, nn.Conv2d)]
    return hooks + [m.register_forward_hook(norm_hook) for m in module.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm)]
