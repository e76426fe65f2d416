"""Gradient and BatchNorm-statistics reduction over every holder of a stage.

The gradient of a stage is the SUM over all its holders (tiles, local-DP copies, GEMS
mirror, full data-parallel replicas): each holder's gradient is already scaled by its
chunks' share of the global batch, so the sum is the gradient of the global mean loss.
One exception: on a spatial stage, parameters used on replicated tensors (an SE gate's
layers) already hold the full gradient of their tile group on every tile, so only tile 0
of each group contributes them (``silent``: the other tiles' copies of those parameters).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn

from ..comm.handles import Group
from ..comm.protocol import Comm
from .bn_replay import RunningStatsLedger, merge_terms, terms_to_cpu


def _grads(module: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    out = []
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append((p, p.grad))
    return out


def _contribution(grads: list[tuple[nn.Parameter, torch.Tensor]], silent: Collection[int]) -> torch.Tensor:
    return torch.cat([torch.zeros_like(g).reshape(-1) if id(p) in silent else g.reshape(-1)
                      for p, g in grads])


def sum_stage_gradients(ctx: Comm, instances: Sequence[nn.Module], group: Group | None,
                        silent: Sequence[Collection[int]] = ()) -> int:
    """Make every instance's gradients the sum over ``instances`` and ``group``; bytes reduced.

    ``instances`` are this rank's copies of one stage (two when a rank holds the stage in
    both GEMS directions); ``group`` is every rank holding the stage. ``silent[i]``: ids of
    parameters of ``instances[i]`` whose gradient this copy does not contribute (see above).
    """
    per_instance = [_grads(m) for m in instances]
    if not per_instance or not per_instance[0]:
        return 0
    quiet = list(silent) + [()] * (len(per_instance) - len(silent))
    flat = _contribution(per_instance[0], quiet[0])
    for grads, ids in zip(per_instance[1:], quiet[1:]):
        flat += _contribution(grads, ids)
    if group is not None and group.size > 1:
        ctx.all_reduce(flat, group=group)
    for grads in per_instance:
        offset = 0
        for _, g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return flat.numel() * flat.element_size()


def sync_running_stats(ctx: Comm, ledgers: Sequence[RunningStatsLedger], group: Group | None) -> None:
    """Replay every holder's BatchNorm terms of one stage in chunk order on all holders."""
    if not any(ledgers):
        return
    local = merge_terms([ledger.terms for ledger in ledgers])
    if group is not None and group.size > 1:
        collected = ctx.all_gather_object(terms_to_cpu(local), group=group)
        local = merge_terms(collected)
    for ledger in ledgers:
        ledger.replay(local)
