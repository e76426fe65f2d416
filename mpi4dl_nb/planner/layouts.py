"""BackendLayouts: shape-only convolutions lay out their result as the real backends do (channels-last stays so).

The ``meta`` kernel of ``aten.convolution`` always returns a contiguous result (it has no backend
to ask), while oneDNN on CPU, cuDNN on CUDA and PyTorch's own CPU kernels return a channels-last
result when the input (or the weight) is channels-last. A model that permutes its maps back from
channels-last (ConvNeXt's blocks) then runs its later layers channels-last on the ranks but
contiguous on ``meta``, and a layer's memory depends on that (``workspace.py``). Entered *outside*
``LiveBytes``, the mode hands the counter only the re-laid result; the contiguous one is never charged.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .workspace import channels_last

CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten._convolution.default)


class BackendLayouts(TorchDispatchMode):
    """Makes a ``meta`` convolution's result channels-last when its input or weight is (thread-local)."""

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Collection[type],
                           args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None) -> object:
        out = func(*args, **(kwargs or {}))
        if func not in CONVOLUTIONS or not isinstance(out, torch.Tensor) or out.device.type != "meta":
            return out
        operands = [t for t in args[:2] if isinstance(t, torch.Tensor)]
        if out.dim() == 4 and not channels_last(out) and any(map(channels_last, operands)):
            return torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=torch.channels_last)
        return out
