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
from .bn_replay import RunningStatsLedger, Term, merge_terms


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
    """The gradients flat, zeros in the places of ``silent`` ones (zeroed in place: no zero copies made)."""
    flat = torch.cat([g.reshape(-1) for _, g in grads])
    offset = 0
    for p, g in grads:
        if id(p) in silent:
            flat[offset:offset + g.numel()].zero_()
        offset += g.numel()
    return flat


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
    alone = len(per_instance) == 1 and (group is None or group.size == 1) and not quiet[0]
    if alone:   # the sum over one copy is its gradient: no flat copy (a parameter-sized tensor at the peak)
        return sum(g.numel() * g.element_size() for _, g in per_instance[0])
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
        local = gather_terms(ctx, local, group, ledgers[0])
    for ledger in ledgers:
        ledger.replay(local)


def gather_terms(ctx: Comm, local: dict[int, Term], group: Group, ledger: RunningStatsLedger) -> dict[int, Term]:
    """Every holder's terms, as ``merge_terms`` of all of them (a chunk held by several holders
    taken from the first in group order), moved as ONE tensor: the holders agree on which
    chunks and calls exist (a small object gather of counts), then each chunk's owner writes its
    terms into its place of a zero buffer and the buffer is summed over the group (adding zeros
    is exact). Pickling every term tensor instead cost ~50 ms a step with AmoebaNet's norms."""
    counts = {chunk: [len(calls) for calls in term] for chunk, term in local.items()}
    everyone = ctx.all_gather_object(counts, group=group)
    owner: dict[int, int] = {}
    for index, theirs in enumerate(everyone):
        for chunk in theirs:
            owner.setdefault(chunk, index)
    widths = [m.running_mean.numel() for m in ledger.norms]
    sample = ledger.norms[0].running_mean
    places, offset = {}, 0
    for chunk in sorted(owner):
        places[chunk] = offset
        offset += sum(2 * width * calls for width, calls in zip(widths, everyone[owner[chunk]][chunk]))
    flat = torch.zeros(offset, dtype=torch.float64, device=sample.device)
    mine = group.rank_of(ctx.rank)
    for chunk, start in places.items():
        if owner[chunk] != mine:
            continue
        pieces = [t.reshape(-1) for calls in local[chunk] for call in calls for t in call]
        if pieces:
            flat[start:start + sum(p.numel() for p in pieces)] = torch.cat(pieces).to(torch.float64)
    ctx.all_reduce(flat, group=group)
    merged: dict[int, Term] = {}
    for chunk, start in places.items():
        term: Term = []
        for norm, (width, calls) in enumerate(zip(widths, everyone[owner[chunk]][chunk])):
            like = ledger.norms[norm].running_mean
            found = []
            for _ in range(calls):
                mean = flat[start:start + width].view_as(like).to(like.dtype)
                var = flat[start + width:start + 2 * width].view_as(like).to(like.dtype)
                found.append((mean, var))
                start += 2 * width
            term.append(found)
        merged[chunk] = term
    return merged
