"""What each ZeRO stage (``--zero-stage``) shards, keeps and does in a step: one record per stage, read by the engine,
the planner and docs/sharding.md's table alike."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class ZeroStage:
    """ZeRO stage ``number``: which of the optimizer state, the gradients and the weights each holder keeps a shard of
    (instead of the whole); ``kept`` and ``step`` say it in words (docs/sharding.md's table)."""

    number: int
    shards_optimizer: bool
    shards_gradients: bool
    shards_weights: bool
    kept: str
    step: str

    @property
    def shards(self) -> bool:
        """Whether anything is sharded (stage 0: nothing)."""
        return self.shards_optimizer

    @property
    def takes_whole_gradients(self) -> bool:
        """Stage 1: the gradients are summed whole (all-reduce) and each shard takes its slice of them."""
        return self.shards_optimizer and not self.shards_gradients

    @property
    def gathers_after_step(self) -> bool:
        """Stages 1-2: the whole weights stay, rebuilt from the updated shards after each step."""
        return self.shards_optimizer and not self.shards_weights


ZERO_STAGES = (
    ZeroStage(0, False, False, False, "weights, whole gradients, whole optimizer state",
              "gradients summed by all-reduce; every holder steps all"),
    ZeroStage(1, True, False, False, "weights, whole gradients, its shard of the optimizer state",
              "all-reduce as at 0; each holder steps its shard; all-gather(v) rebuilds the weights"),
    ZeroStage(2, True, True, False, "weights, its shard of the gradients and optimizer state",
              "reduce-scatter of the gradients into the shards (the whole gradient freed); step; all-gather(v)"),
    ZeroStage(3, True, True, True, "its shard of the weights, gradients and optimizer state",
              "as 2, but the weights stay sharded: each layer's gathered before its forward and its backward, "
              "freed after, the next one prefetched"),
)


def zero_stage(number: int) -> ZeroStage:
    """The record of ZeRO stage ``number``; ConfigError naming ``--zero-stage`` for another number."""
    if isinstance(number, bool) or number not in range(len(ZERO_STAGES)):
        raise ConfigError("--zero-stage", f"is 0 (nothing sharded), 1, 2 or 3, not {number!r}")
    return ZERO_STAGES[number]
