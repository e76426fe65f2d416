"""Gradient clipping by the global norm of the whole model's gradient, each element counted once over every rank."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ..comm.protocol import Comm

EPSILON = 1e-6   # torch.nn.utils.clip_grad_norm_'s: the coefficient is max_norm / (norm + EPSILON)


def clip_by_global_norm(ctx: Comm, counted: Iterable[torch.Tensor], scaled: Iterable[torch.Tensor],
                        max_norm: float) -> float:
    """Scale ``scaled`` by ``min(1, max_norm / (norm + EPSILON))`` as ``clip_grad_norm_`` does; ``norm`` is the
    square root of the sum over the world of ``counted``'s squares (float64), so every element of the model's
    gradient must lie in the ``counted`` of exactly one rank (a shard on its holder; a stage held whole on its
    lowest holder). Collective over the world; returns the norm."""
    total = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    for grad in counted:
        total += grad.detach().to(torch.float64).square().sum()
    norm = float(ctx.all_reduce(total).sqrt().item())
    coefficient = min(1.0, max_norm / (norm + EPSILON))
    for grad in scaled:
        grad.mul_(coefficient)
    return norm
