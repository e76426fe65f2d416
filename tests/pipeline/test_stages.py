"""Stages: splitting by balance, whole-model keys, cost-balanced cuts, profiling."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.pipeline.stages import (
    auto_balance,
    even_balance,
    partition_costs,
    profile_layer_memory,
    profile_layer_times,
    split_layers,
)
from tests.support.models import build, cell_stack


def test_even_balance_puts_remainder_last():
    assert even_balance(5, 2) == (2, 3)
    assert even_balance(7, 3) == (2, 2, 3)
    with pytest.raises(ConfigError, match="split_size"):
        even_balance(2, 3)


def test_bad_balance_names_the_knob_and_a_fix():
    layers = [nn.Identity() for _ in range(5)]
    with pytest.raises(ConfigError, match=r"balance.*\[2, 3\]"):
        split_layers(layers, 2, balance=(1, 1))
    with pytest.raises(ConfigError, match="balance"):
        split_layers(layers, 2, balance=(1, 2, 2))


def test_stages_run_like_sequential_with_whole_model_keys():
    layers = build("cells")
    serial = nn.Sequential(*build("cells"))
    stages = split_layers(layers, 3, balance=(1, 3, 2))
    assert [s.offset for s in stages] == [0, 1, 4]
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    y = x
    for stage in stages:
        y = stage(y)
        if stage.index < 2:
            assert isinstance(y, tuple) and len(y) == 2   # skip pairs cross the cut
    torch.testing.assert_close(y, serial(x), rtol=0, atol=0)
    keys = [k for s in stages for k in s.full_state_dict()]
    assert keys == list(serial.state_dict())


def test_load_from_full_is_inverse():
    stages = split_layers(build("resnet"), 2)
    other = nn.Sequential(*build("resnet", seed=3)).state_dict()
    for s in stages:
        s.load_from_full(other)
        for key, value in s.full_state_dict().items():
            assert torch.equal(value, other[key])
    with pytest.raises(KeyError, match="stage 1"):
        stages[1].load_from_full({})


def brute_force(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or worst < best:
            best = worst
    return best


@pytest.mark.parametrize("costs,k", [([1, 2, 3, 4, 5], 2), ([5, 1, 1, 1, 1, 5], 3),
                                     ([3, 3, 3, 3], 4), ([9, 1, 1, 1], 2), ([1], 1)])
def test_partition_costs_is_optimal(costs, k):
    counts = partition_costs(costs, k)
    assert len(counts) == k and sum(counts) == len(costs) and min(counts) >= 1
    bounds = [0, *itertools.accumulate(counts)]
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == brute_force(costs, k)


def test_memory_profile_sees_big_layers_and_leaves_stats_alone():
    layers = [nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.Conv2d(32, 2, 1),
              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 2)]
    x = torch.randn(2, 3, 32, 32)
    sizes = profile_layer_memory(layers, x)
    assert len(sizes) == 6
    assert sizes[1] > sizes[5]           # BN on a 32-channel map saves far more than a tiny fc
    assert torch.equal(layers[1].running_mean, torch.zeros(32))   # ran on copies
    assert partition_costs(sizes, 2)[0] <= 3


def test_time_profile_and_auto_balance():
    layers = cell_stack()
    x = torch.randn(2, 3, 16, 16)
    times = profile_layer_times(layers, x, repeats=1)
    assert len(times) == 6 and all(t > 0 for t in times)
    for by in ("time", "memory"):
        balance = auto_balance(layers, x, 3, by=by, repeats=1)
        assert len(balance) == 3 and sum(balance) == 6
    with pytest.raises(ValueError, match="'time' or 'memory'"):
        auto_balance(layers, x, 2, by="flops")


def test_auto_balanced_config_single_process():
    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.pipeline.engine import auto_balanced_config

    cfg = ParallelConfig(split_size=3, spatial_size=0)
    tuned = auto_balanced_config(cfg, cell_stack(), torch.randn(2, 3, 16, 16), by="memory")
    assert tuned.balance is not None and sum(tuned.balance) == 6 and len(tuned.balance) == 3
    assert tuned.with_(balance=None) == cfg


def test_default_balance_keeps_full_resolution_activations_off_the_layer_rank():
    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.models import build_model
    from mpi4dl_nb.pipeline.stages import default_balance, layer_memory, partition_stages

    # the contiguous cut minimising the largest stage cost, by brute force on a toy cost
    costs = [5, 1, 1, 7, 2, 2, 3]
    cut = partition_stages(len(costs), 3, lambda stage, a, b: sum(costs[a:b]))
    best = min((c for c in itertools.product(range(1, 6), repeat=3) if sum(c) == 7),
               key=lambda c: max(sum(costs[s:s + n]) for s, n in zip(itertools.accumulate((0, *c[:-1])), c)))
    bounds = list(itertools.accumulate((0, *cut)))
    assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == \
        max(sum(costs[s:s + n]) for s, n in zip(itertools.accumulate((0, *best[:-1])), best))
    layers = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
    flagship = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)
    balance = default_balance(layers, flagship)
    assert balance == (len(layers) - 1, 1)                                    # the layer rank: the head
    assert default_balance(layers, flagship.with_(balance=(3, 2))) == (3, 2)   # an explicit balance wins
    assert default_balance(layers, ParallelConfig(split_size=2, spatial_size=0)) == even_balance(len(layers), 2)
    saved = [m.saved_bytes for m in layer_memory(layers, torch.empty(1, 3, 256, 256, device="meta"))]
    tile_share = sum(saved[:balance[0]]) / 4
    assert sum(saved[balance[0]:]) < tile_share          # the layer rank keeps less than one tile
