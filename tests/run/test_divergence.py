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
