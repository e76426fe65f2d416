"""Planner: layer profiles, the per-rank estimate against measured peaks, and suggest()."""

from __future__ import annotations

import pytest
import torch
from ipyparallel import interactive
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.models import build_model

MB = 2 ** 20


def test_profile_counts_saved_activations_once_and_excludes_weights():
    layers = [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()), nn.Conv2d(8, 4, 1)]
    prof = planner.profile_layers(layers, (16, 20))
    px = 16 * 20 * 4
    assert prof[0].saved_bytes == 3 * px + 8 * px        # conv input + relu output
    assert prof[1].saved_bytes == 0                      # its input is the relu output: once
    assert prof[0].param_bytes == (8 * 3 * 9 + 8) * 4
    assert prof[0].out_shapes == ((1, 8, 16, 20),) and prof[0].spatial_dims == (16, 20)
    assert prof[0].flops >= 2 * 8 * 16 * 20 * 27
    assert prof[0].window_in_bytes == 3 * px and prof[1].window_in_bytes == 0


def test_estimate_follows_schedule_batch_and_tiles():
    layers = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
    profiles = planner.profile_layers(layers, 64)
    gpipe = planner.estimate_memory(profiles, ParallelConfig(split_size=3, spatial_size=0, parts=4), 64, 4)
    f1b = planner.estimate_memory(profiles, ParallelConfig(split_size=3, spatial_size=0, parts=4,
                                                           schedule="1f1b"), 64, 4)
    # GPipe keeps all 4 micro-batches alive on stage 0; 1F1B at most 3 (stages - 0).
    assert f1b.ranks[0].activations == pytest.approx(gpipe.ranks[0].activations * 3 / 4, rel=1e-6)
    assert f1b.ranks[2].activations < gpipe.ranks[2].activations
    one = planner.estimate_memory(profiles, ParallelConfig(split_size=1, spatial_size=0), 64, 1)
    two = planner.estimate_memory(profiles, ParallelConfig(split_size=1, spatial_size=0), 64, 2)
    assert two.ranks[0].activations == 2 * one.ranks[0].activations
    sp2 = planner.estimate_memory(profiles, ParallelConfig(split_size=2, spatial_size=1,
                                                           num_spatial_parts=2, slice_method="vertical"), 64, 1)
    sp4 = planner.estimate_memory(profiles, ParallelConfig(split_size=2, spatial_size=1,
                                                           num_spatial_parts=4), 64, 1)
    assert sp4.ranks[0].activations < sp2.ranks[0].activations
    assert sp4.ranks[4].total == pytest.approx(sp2.ranks[2].total)   # the LP stage is unchanged
    gems = planner.estimate_memory(profiles, ParallelConfig(split_size=2, spatial_size=0, times=1), 64, 2)
    assert gems.ranks[0].params == gems.ranks[1].params == sum(p.param_bytes for p in profiles)
    assert "rank" in gems.table() and len(gems.totals) == 2


def test_serial_estimate_within_25_percent_of_measured():
    torch.manual_seed(0)
    for depth, width, size, batch in ((11, 16, 96, 2), (20, 8, 64, 4)):
        layers = build_model("resnet", num_layers=depth, num_filters=width, num_classes=2)
        plan = planner.estimate_memory(layers, ParallelConfig(split_size=1, spatial_size=0), size, batch)
        model = nn.Sequential(*layers)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(batch, 3, size, size), torch.randint(0, 2, (batch,))

        def step(model=model, x=x, y=y, opt=opt):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        step()
        measured = planner.measure_step_memory(step, [model], opt)
        assert abs(plan.peak / measured - 1) < 0.25, (depth, plan.peak / MB, measured / MB)


def test_suggest_ranks_fitting_valid_configs():
    layers = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
    serial = planner.estimate_memory(layers, ParallelConfig(split_size=1, spatial_size=0), 128, 2).peak
    budget = 0.8 * serial
    found = planner.suggest(layers, 128, budget, 5, batch_size=2, top=None)
    assert found, "some split must fit in 80% of the serial memory"
    for s in found:
        assert s.world_size <= 5 and s.peak_bytes <= budget
        s.cfg.validate(batch_size=2, num_layers=len(layers))
        assert s.cfg.spatial_size < s.cfg.split_size
    speeds = [s.speedup for s in found]
    assert speeds == sorted(speeds, reverse=True)
    assert "ranks" in found[0].describe()
    with pytest.raises(ValueError, match="raise devices or memory_per_device"):
        planner.suggest(layers, 128, serial / 1000, 2, batch_size=2)


@interactive  # shipped by value to the engines
def _measure_on_engine(cfg_dict, image_size, batch, depth, width):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.models import build_model
    from mpi4dl_nb.notebook.planner import measure_engine_step

    torch.set_num_threads(1)
    ctx = dl.init()
    torch.manual_seed(0)
    layers = build_model("resnet", num_layers=depth, num_filters=width, num_classes=2)
    eng = dl.HybridEngine(layers, dl.ParallelConfig(**cfg_dict), ctx, loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    x, y = torch.randn(batch, 3, image_size, image_size), torch.randint(0, 2, (batch,))
    return measure_engine_step(eng, x, y)


PARALLEL_CASES = [   # all on 3 ranks: one cluster start
    (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical"), 2),
    (dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2), 4),
    (dict(split_size=3, spatial_size=0, parts=2), 2),
    (dict(split_size=3, spatial_size=0, times=1), 2),
]


def test_parallel_estimates_within_25_percent_of_measured_on_every_rank():
    from mpi4dl_nb import cluster as clu

    depth, width, size = 11, 16, 128
    layers = build_model("resnet", num_layers=depth, num_filters=width, num_classes=2)
    with clu.start(n=3, call_timeout=300) as cluster:
        for knobs, batch in PARALLEL_CASES:
            plan = planner.estimate_memory(layers, ParallelConfig(**knobs), size, batch)
            measured = cluster.run(_measure_on_engine, knobs, size, batch, depth, width)
            ratios = [e / m for e, m in zip(plan.totals, measured)]
            assert all(abs(r - 1) < 0.25 for r in ratios), (knobs, ratios)
