"""What ``--zero-stage`` shards of a run, from the layout and the model's trained and frozen parameters: said in one
line at set-up when that is little or nothing (one process, stages of one holder each, a frozen base)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..config import ParallelConfig
from ..layout import stage_holders

MB = 2 ** 20


@dataclass(frozen=True)
class StageShare:
    """One stage: its holders (the ranks ZeRO shards it over), its trained and its frozen parameters' bytes."""

    stage: int
    holders: int
    trained: int
    frozen: int


def megabytes(count: int) -> str:
    """``count`` bytes as MB: one decimal from 10 MB, three below."""
    return f"{count / MB:,.1f} MB" if count >= 10 * MB else f"{count / MB:.3f} MB"


def stage_shares(cfg: ParallelConfig, layers: Sequence[nn.Module],
                 image_size: int | tuple[int, int, int]) -> list[StageShare]:
    """Each stage of the engine's cut of ``layers`` with its holders and parameter bytes (a parameter once)."""
    if cfg.split_size == 1:
        balance: Sequence[int] = (len(layers),)
    else:
        from ..pipeline.default_cut import default_balance

        balance = cfg.balance or default_balance(layers, cfg, image_size=image_size if isinstance(image_size, int)
                                                 else None)
    shares = []
    bounds = zip((0, *itertools.accumulate(balance)), itertools.accumulate(balance))
    for stage, (start, stop) in enumerate(bounds):
        params = {id(p): p for layer in layers[start:stop] for p in layer.parameters()}.values()
        sizes = [(p.requires_grad, p.numel() * p.element_size()) for p in params]
        shares.append(StageShare(stage, len(stage_holders(cfg, stage)), sum(b for t, b in sizes if t),
                                 sum(b for t, b in sizes if not t)))
    return shares


def zero_note(cfg: ParallelConfig, shares: Sequence[StageShare]) -> str | None:
    """The line saying what ``cfg.zero_stage`` shards when that is less than half of the parameters' bytes (their
    gradients and optimizer state with them), and why: one process, stages held by one rank, frozen parameters
    (never sharded: a LoRA base, frozen blocks); None at level 0 or when it shards most of them."""
    if cfg.zero_stage == 0:
        return None
    total = sum(s.trained + s.frozen for s in shares)
    sharded = sum(s.trained for s in shares if s.holders > 1)
    if 2 * sharded >= total:
        return None
    lone = [s for s in shares if s.holders == 1 and s.trained]
    frozen = sum(s.frozen for s in shares)
    reasons = []
    if cfg.world_size == 1:
        reasons.append("one process holds every stage, so there is no other holder to shard over")
    elif lone:
        named = ", ".join(str(s.stage) for s in lone)
        reasons.append(f"stage{'s' * (len(lone) > 1)} {named} {'are' if len(lone) > 1 else 'is'} held by one rank "
                       f"({megabytes(sum(s.trained for s in lone))} kept whole)")
    if frozen and cfg.world_size > 1:
        reasons.append(f"frozen parameters are never sharded ({megabytes(frozen)}: a LoRA base, frozen blocks)")
    what = "nothing" if not sharded else f"{megabytes(sharded)}"
    return (f"--zero-stage {cfg.zero_stage} shards {what} of the model's {megabytes(total)} of parameters (with "
            f"their gradients and optimizer state): {'; '.join(reasons)}")
