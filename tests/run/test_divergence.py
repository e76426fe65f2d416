"""Divergence guard pieces: finding a non-finite tensor, watching chunk losses."""
from __future__ import annotations

import math

import torch

from mpi4dl_nb.run.divergence import LossWatch, NonFiniteGuard, first_nonfinite


def test_first_nonfinite_searches_nested_state():
    good = {"w": torch.ones(3), "steps": torch.tensor(4)}
    assert first_nonfinite([("model", good)]) is None
    bad = {"layer": {"w": torch.ones(2), "v": torch.tensor([1.0, math.inf])}}
    assert first_nonfinite([("model", good), ("optimizer", bad)]) == "optimizer.layer.v"
    assert first_nonfinite([("g", torch.tensor([math.nan]))]) == "g"


def test_a_sum_that_overflows_is_no_false_alarm_and_opposite_infinities_are_found():
    """The quick screen sums each tensor: a finite tensor whose float32 (or half) sum overflows is still clean, and
    +inf beside -inf (a NaN sum) or a NaN among half values are still found, first bad tensor named."""
    big = torch.full((4,), 3e38)                                   # finite; its float32 sum is inf
    halves = torch.full((8,), 60000.0, dtype=torch.float16)       # finite; a float16 sum would overflow
    assert math.isinf(big.sum().item()) and first_nonfinite([("big", big), ("halves", halves)]) is None
    both = torch.tensor([math.inf, -math.inf, 1.0])
    assert first_nonfinite([("big", big), ("both", both)]) == "both"
    halves[3] = math.nan
    assert first_nonfinite([("big", big), ("halves", halves), ("both", both)]) == "halves"


def test_loss_watch_keeps_the_first_bad_chunk_loss():
    watch = LossWatch(lambda out, target: out.sum())
    watch(torch.ones(2), None)
    assert watch.bad is None
    watch(torch.tensor([math.nan]), None)
    watch(torch.tensor([math.inf]), None)
    assert math.isnan(watch.bad)
    watch.reset()
    assert watch.bad is None


def test_description_names_ranks_and_the_first_tensor():
    text = NonFiniteGuard.describe([(4, math.nan)], [(0, "0.conv.weight"), (2, "5.fc.bias")],
                                   [(1, "1.bn1.running_var")])
    assert "non-finite loss (nan on rank 4, the last stage)" in text
    assert "non-finite gradients on ranks 0, 2 (first: 0.conv.weight on rank 0)" in text
    assert "non-finite BatchNorm statistics on rank 1 (first: 1.bn1.running_var on rank 1)" in text
