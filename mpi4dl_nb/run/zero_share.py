"""What ``--zero-stage`` shards of a run (from the layout and the trained and frozen parameters), said in one line at
set-up when that is little or nothing: one process, stages of one holder each, a frozen base."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from torch import nn

from ..config import ParallelConfig
from ..layout import stage_holders


class StageShare(NamedTuple):
    """One stage: its holders (the ranks ZeRO shards it over), its trained and its frozen parameters' bytes."""

    stage: int
    holders: int
    trained: int
    frozen: int


def megabytes(count: int) -> str:
    """``count`` bytes in MB: one decimal from 10 MB, three below."""
    return f"{count / 2 ** 20:,.1f}" if count >= 10 * 2 ** 20 else f"{count / 2 ** 20:.3f}"


def stage_shares(cfg: ParallelConfig, layers: Sequence[nn.Module], size: int | tuple[int, ...]) -> list[StageShare]:
    """Each stage of the engine's cut of ``layers`` with its holders and parameter bytes (a parameter once)."""
    from ..pipeline.default_cut import default_balance

    balance = (len(layers),) if cfg.split_size == 1 else cfg.balance or default_balance(
        layers, cfg, image_size=size if isinstance(size, int) else None)
    shares = []
    for stage, (start, stop) in enumerate(zip((0, *itertools.accumulate(balance)), itertools.accumulate(balance))):
        params = {id(p): p for layer in layers[start:stop] for p in layer.parameters()}.values()
        sizes = [(p.requires_grad, p.numel() * p.element_size()) for p in params]
        shares.append(StageShare(stage, len(stage_holders(cfg, stage)), sum(b for t, b in sizes if t),
                                 sum(b for t, b in sizes if not t)))
    return shares


def zero_note(cfg: ParallelConfig, shares: Sequence[StageShare]) -> str | None:
    """The line saying what ``cfg.zero_stage`` shards when it is less than half the parameters' bytes, and why;
    None at level 0 or when it shards most of them."""
    total, sharded = sum(s.trained + s.frozen for s in shares), sum(s.trained for s in shares if s.holders > 1)
    if cfg.zero_stage == 0 or 2 * sharded >= total:
        return None
    lone, frozen = [s for s in shares if s.holders == 1 and s.trained], sum(s.frozen for s in shares)
    reasons = ["one process holds every stage, so there is no other holder to shard over"] if cfg.world_size == 1 \
        else [f"stage{'s' * (len(lone) > 1)} {', '.join(str(s.stage) for s in lone)} {'are' if len(lone) > 1 else 'is'}"
              f" held by one rank ({megabytes(sum(s.trained for s in lone))} MB kept whole)"] if lone else []
    if frozen and cfg.world_size > 1:
        reasons.append(f"frozen parameters are never sharded ({megabytes(frozen)} MB: a LoRA base, frozen blocks)")
    return (f"--zero-stage {cfg.zero_stage} shards {megabytes(sharded) + ' MB' if sharded else 'nothing'} of the "
            f"model's {megabytes(total)} MB of parameters (with their gradients and optimizer state): "
            f"{'; '.join(reasons)}")
