"""Mixed precision of a step: autocast for forwards, float32 master weights, fp16 loss scaling on GPU.

``--precision bf16`` runs every stage's forward (and the loss) under ``torch.autocast`` with
bfloat16, on CPU and GPU: convolutions and matrix products compute in bfloat16, so
activations, halo strips and pipeline messages travel in bfloat16 (half the bytes); the
parameters, their gradients and the optimizer stay float32, and normalisation statistics
accumulate in float32 (spatial norms upcast). ``fp16`` (GPU only) adds dynamic loss scaling:
the loss is multiplied by ``scale`` before backward, gradients are divided by it before the
optimizer step, and a step whose gradients are not finite on any rank is skipped by every rank
(scale halved; doubled after ``growth_interval`` good steps), as ``torch.amp.GradScaler`` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

from ..comm.protocol import Comm
from ..config import PrecisionMode
from ..errors import ConfigError

COMPUTE_DTYPES = {PrecisionMode.BF16: torch.bfloat16, PrecisionMode.FP16: torch.float16}


def check_precision(precision: PrecisionMode, device: torch.device, param_dtype: torch.dtype | None) -> None:
    """ConfigError when ``precision`` cannot run on ``device`` with parameters of ``param_dtype``."""
    if precision is PrecisionMode.FP32:
        return
    if precision is PrecisionMode.FP16 and device.type != "cuda":
        raise ConfigError("precision", f"fp16 needs a GPU (loss scaling of float16 gradients); this "
                          f"rank computes on {device.type}: use --precision bf16 (CPU and GPU) or fp32")
    if param_dtype is not None and param_dtype != torch.float32:
        raise ConfigError("precision", f"{precision} autocasts float32 master weights, but the "
                          f"model's parameters are {param_dtype}; build the model in float32 "
                          f"or use --precision fp32")


def autocast(precision: PrecisionMode, device: torch.device) -> AbstractContextManager[object]:
    """The context a forward runs in: autocast to the compute dtype, or nothing for fp32."""
    dtype = COMPUTE_DTYPES.get(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class LossScaler:
    """Dynamic loss scaling, identical on every rank (the skip decision is all-reduced)."""

    def __init__(self, scale: float = 2.0 ** 16, growth_interval: int = 2000) -> None:
        self.scale = float(scale)
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (what backward starts from)."""
        return loss * self.scale

    def unscale(self, ctx: Comm, parameters: Iterable[torch.nn.Parameter], device: torch.device) -> bool:
        """Divide gradients by the scale; True when every rank's gradients are finite (collective)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        bad = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            g.div_(self.scale)
            bad += (~torch.isfinite(g)).any().to(bad.dtype)
        ctx.all_reduce(bad)
        finite = float(bad.item()) == 0.0
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.skipped += 1
            self.good_steps = 0
            self.scale /= 2.0
        return finite
