"""Who sums each stage's gradients over its holders at the stage's ALLREDUCE action, chosen once per stage: ZeRO's
reduce-scatter into the shards, buckets posted during backward (``grad_buckets.py``), or one all-reduce."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from ..comm.handles import Group
from ..comm.protocol import Comm
from ..config import ParallelConfig
from ..sharding.seam import Sharding
from .dataparallel import sum_stage_gradients
from .grad_buckets import MB, GradientReducer
from .stage_instance import StageInstance, silent_of

StageSum = Callable[[], int]   # sums one stage's gradients over its holders; the bytes it put in


def gradient_sums(ctx: Comm, cfg: ParallelConfig, stage_groups: dict[int, Group | None],
                  copies_of: Callable[[int], Sequence[StageInstance]],
                  sharding: Sharding) -> tuple[dict[int, StageSum], GradientReducer | None]:
    """Each held stage's gradient sum, and the bucket reducer (``cfg.grad_bucket_mb``; None: one all-reduce per
    stage) holding the buckets of every stage shared with other holders whose gradients ZeRO does not sum."""
    reducer = GradientReducer(ctx, cfg.grad_bucket_mb * MB) if cfg.grad_bucket_mb is not None else None
    sums: dict[int, StageSum] = {}
    for stage, group in sorted(stage_groups.items()):
        copies = list(copies_of(stage))
        if sharding.sums_gradients(stage):
            sums[stage] = partial(sharding.reduce_gradients, stage)
            continue
        if reducer is not None and group is not None and group.size > 1:
            reducer.add_stage(stage, [i.module for i in copies], group, silent_of(copies))
        if reducer is not None and reducer.covers(stage):
            sums[stage] = partial(reducer.finish, stage)   # buckets posted during backward: the rest, then wait
        else:
            sums[stage] = partial(_all_at_once, ctx, copies, group)
    return sums, reducer


def _all_at_once(ctx: Comm, copies: Sequence[StageInstance], group: Group | None) -> int:
    return sum_stage_gradients(ctx, [i.module for i in copies], group, [i.silent_parameters() for i in copies])
