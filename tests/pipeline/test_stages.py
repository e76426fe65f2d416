"""Stages: splitting by balance, whole-model keys, cost-balanced cuts, profiling."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.pipeline.default_cut import auto_balance, even_balance, partition_stages
from mpi4dl_nb.pipeline.layer_probe import profile_layer_memory, profile_layer_times
from mpi4dl_nb.pipeline.stages import split_layers
from tests.mpi import tile_fit_exact
from tests.support.battery import shared_job
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


def summed(costs):
    """The stage cost of ``auto_balance``: the sum of the layers' costs."""
    return lambda stage, start, stop: sum(costs[start:stop])


@pytest.mark.parametrize("later_lighter", [False, True])
@pytest.mark.parametrize("costs,k", [([1, 2, 3, 4, 5], 2), ([5, 1, 1, 1, 1, 5], 3),
                                     ([3, 3, 3, 3], 4), ([9, 1, 1, 1], 2), ([1], 1)])
def test_partition_stages_is_optimal(costs, k, later_lighter):
    counts = partition_stages(len(costs), k, summed(costs), later_lighter)
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
    assert partition_stages(len(sizes), 2, summed(sizes), later_lighter=True)[0] <= 3


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
    from mpi4dl_nb.pipeline.default_cut import default_balance
    from mpi4dl_nb.pipeline.layer_probe import layer_memory

    # the contiguous cut minimising the largest stage cost, by brute force on a toy cost
    costs = [5, 1, 1, 7, 2, 2, 3]
    cut = partition_stages(len(costs), 3, summed(costs))
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


# ------------------------------------------------------------- a default cut that fits the tiles
def wide_halo_stack(first: int = 3) -> list[nn.Module]:
    """Two 3x3 convs (reach 1; the first ``first`` x ``first``), a 7x7 conv (reach 3), a 3x3 conv, the
    pooled head: on 2-px tile columns only the first two fit, though the memory-optimal cut wants all
    four convs on the tiles."""
    torch.manual_seed(0)
    return [nn.Conv2d(3, 8, first, padding=first // 2), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 7, padding=3),
            nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)]


def fitting_cuts(num_layers: int, cfg, limit: int) -> list[tuple[int, ...]]:
    return [c for c in itertools.product(range(1, num_layers + 1), repeat=cfg.split_size)
            if sum(c) == num_layers and sum(c[:cfg.spatial_size]) <= limit]


@pytest.mark.parametrize("split, spatial", [(2, 1), (3, 1), (3, 2)])
def test_default_cut_keeps_layers_wider_than_a_tile_off_the_spatial_stages(split, spatial):
    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.pipeline.default_cut import default_balance, memory_cost
    from mpi4dl_nb.pipeline.layer_probe import probe_memory
    from mpi4dl_nb.pipeline.tile_fit import tile_reach
    from mpi4dl_nb.run.trainer import check_spatial_geometry

    layers = wide_halo_stack()
    cfg = ParallelConfig(split_size=split, spatial_size=spatial, num_spatial_parts=8, slice_method="vertical")
    reach = tile_reach(layers, cfg, 16)
    assert reach is not None and reach.layers == 2 and "2 (cols)" in str(reach.refusal)
    unchecked = default_balance(layers, cfg)
    assert sum(unchecked[:spatial]) > 2                        # the cut that ignores the tiles misfits
    with pytest.raises(ConfigError, match="halo is wider than a tile"):
        check_spatial_geometry(layers, cfg.with_(balance=unchecked), 16)
    balance = default_balance(layers, cfg, image_size=16)
    assert sum(balance[:spatial]) <= 2
    check_spatial_geometry(layers, cfg, 16)                    # the pre-flight checks the engine's cut
    # the best of the fitting cuts by the rule's cost (brute force over every contiguous cut)
    cost = memory_cost(cfg, probe_memory(layers), lambda stage, stop: True)

    def worst(cut: tuple[int, ...]) -> float:
        bounds = list(itertools.accumulate((0, *cut)))
        return max(cost(s, a, b) for s, (a, b) in enumerate(zip(bounds, bounds[1:])))
    assert worst(balance) == min(map(worst, fitting_cuts(len(layers), cfg, 2)))
    assert default_balance(layers, cfg, image_size=64) == unchecked   # 8-px columns: everything fits


def test_a_balance_that_does_not_fit_is_refused_naming_one_that_does():
    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.pipeline.default_cut import check_fit

    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=8, slice_method="vertical",
                         balance=(4, 3))
    with pytest.raises(ConfigError, match=r": 2 \(cols\).*--balance 2,5 fits"):
        check_fit(wide_halo_stack(), cfg, 16)
    assert check_fit(wide_halo_stack(), cfg.with_(balance=(2, 5)), 16) == (2, 5)


def test_layout_s_stage_table_refuses_a_balance_that_does_not_fit_as_train_does():
    from mpi4dl_nb.cli.stage_table import stage_table
    from mpi4dl_nb.config import ParallelConfig

    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=8, slice_method="vertical")
    with pytest.raises(ConfigError, match="--balance 2,5 fits"):
        stage_table(wide_halo_stack(), cfg.with_(balance=(4, 3)), 16)
    assert stage_table(wide_halo_stack(), cfg, 16).endswith("balance: 2,5 (7 layers, 16 px images)")


def test_no_fitting_cut_names_image_sizes_and_tile_counts_that_work():
    import re

    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.pipeline.default_cut import default_balance

    layers = wide_halo_stack(first=5)
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=8, slice_method="vertical")
    with pytest.raises(ConfigError, match="layer 0 does not fit") as refused:
        default_balance(layers, cfg, image_size=8)             # 1-px columns: the 5x5 conv reaches 2
    message = str(refused.value)
    size, balance = re.search(r"--image-size (\d+) fits \(there the default cut is --balance ([\d,]+)\)",
                              message).groups()
    assert default_balance(layers, cfg, image_size=int(size)) == tuple(map(int, balance.split(",")))
    parts = int(re.search(r"--num-spatial-parts (\d+) fits", message).group(1))
    default_balance(layers, cfg.with_(num_spatial_parts=parts), image_size=8)


def test_without_a_memory_probe_the_cut_is_even_or_the_evenest_that_fits():
    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.pipeline.default_cut import fitting_cut

    cfg = ParallelConfig(split_size=3, spatial_size=1, num_spatial_parts=4)
    assert fitting_cut(cfg, 9, None, 9) == (3, 3, 3)
    assert fitting_cut(cfg, 9, None, 2) in {(2, 3, 4), (2, 4, 3)}
    assert fitting_cut(cfg.with_(split_size=3, spatial_size=2), 9, None, 1) is None


def test_mpi4dl_amoebanet_example_at_128_px_gets_a_cut_that_fits():
    """``train --model amoebanet --image-size 128 --num-layers 3 --num-filters 16 --split-size 2
    --spatial-size 1 --num-spatial-parts 4 --slice-method vertical``: refused before the cut knew the tiles."""
    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.models import build_model
    from mpi4dl_nb.pipeline.default_cut import default_balance
    from mpi4dl_nb.run.trainer import check_layout

    layers = build_model("amoebanet", num_layers=3, num_filters=16, image_size=128)
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="vertical")
    check_layout(cfg, layers, 1, 128)
    assert default_balance(layers, cfg, image_size=128) == (4, 5)


def test_an_se_gate_s_pointwise_convs_on_the_pooled_map_do_not_stop_the_reach():
    """A 1x1 conv on the 1x1 map of a global pool reads no neighbour (the map is the same on every tile)."""
    from benchmarks.support.dense_models import SqueezeExcite
    from mpi4dl_nb.config import ParallelConfig
    from mpi4dl_nb.pipeline.tile_fit import tile_reach

    layers = [nn.Conv2d(3, 8, 3, padding=1), SqueezeExcite(8, conv=True), nn.Conv2d(8, 8, 3, padding=1),
              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)]
    reach = tile_reach(layers, ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4), 32)   # 2x2
    assert reach is not None and reach.refusal is None and reach.layers == len(layers)


TILE_FIT = shared_job(5, "tile_fit_exact", timeout=300)


def test_the_fitting_cut_trains_exactly_on_five_ranks(shared_launch):
    """AmoebaNet at 128 px on 1x4 tiles: the engine's cut fits, and equals one process (float64)."""
    shared_launch(TILE_FIT).require_clean(tile_fit_exact.CHECKS)
