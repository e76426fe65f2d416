"""Dropout and stochastic depth on two stages or on replicas are refused before training; micro-batches are not."""

from __future__ import annotations

import pytest
from torch import nn

from mpi4dl_nb.config import ConfigError, ParallelConfig
from mpi4dl_nb.pipeline.default_cut import draws_in_training
from mpi4dl_nb.pipeline.stage_draws import drawing_stages, draws_refusal


def layers() -> list[nn.Module]:
    """Six layers; 2 and 4 draw in training (a Dropout inside a block, a bare one); 5's dropout has p=0."""
    return [nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Sequential(nn.Conv2d(4, 4, 1), nn.Dropout2d(0.2)),
            nn.Flatten(), nn.Dropout(0.5), nn.Sequential(nn.Linear(4 * 16, 3), nn.Dropout(0.0))]


def test_draws_in_training_finds_dropout_and_stochastic_depth_of_nonzero_rate():
    assert draws_in_training(layers()) == [False, False, True, False, True, False]
    assert drawing_stages(layers(), (3, 3)) == {0: "2.1", 1: "4"}
    timm = pytest.importorskip("timm")
    path = timm.layers.DropPath(0.1)
    assert draws_in_training([path, timm.layers.DropPath(0.0), nn.Dropout(0.0)]) == [True, False, False]


@pytest.mark.parametrize("balance", [(3, 3), (2, 1, 3), (3, 1, 2)])
def test_drawing_layers_on_two_stages_are_refused_naming_each_stage_and_a_cut_keeping_them_on_one(balance):
    cfg = ParallelConfig(split_size=len(balance), spatial_size=0, balance=balance)
    refusal = draws_refusal(layers(), balance, cfg)
    assert isinstance(refusal, ConfigError) and refusal.knob == "balance", refusal
    assert "(first: 2.1)" in str(refusal) and "(first: 4)" in str(refusal) and "lie on 2 stages" in str(refusal)
    assert "--balance" in str(refusal) and "drop_path_rate=0" in str(refusal)
    kept = str(refusal).split("--balance ")[1].split(";")[0]
    assert len(drawing_stages(layers(), tuple(map(int, kept.split(","))))) == 1, kept


@pytest.mark.parametrize("knobs", [dict(split_size=2, spatial_size=0, balance=(5, 1), parts=2),
                                   dict(split_size=2, spatial_size=0, balance=(2, 4), schedule="1f1b", parts=4),
                                   dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                                        balance=(3, 3), local_dp=2),
                                   dict(split_size=1, spatial_size=0)])
def test_one_rank_drawing_each_stage_s_samples_in_order_is_allowed(knobs):
    """Micro-batches draw in the serial reference's chunk order on the one rank of their stage; ``local_dp`` copies
    only the layer stages (here the draws are on the tiles of the spatial one)."""
    cfg = ParallelConfig(**knobs)
    drawing = layers()
    if cfg.local_dp > 1:
        drawing[4] = nn.Identity()   # the draws on stage 0 alone: its tiles run every sample
    assert draws_refusal(drawing, cfg.balance or (6,), cfg) is None


@pytest.mark.parametrize("knobs,knob", [(dict(split_size=1, spatial_size=0, data_parallel=2), "data_parallel"),
                                        (dict(split_size=2, spatial_size=0, times=1, balance=(5, 1)), "times"),
                                        (dict(split_size=2, spatial_size=1, num_spatial_parts=2, balance=(1, 5),
                                              slice_method="vertical", local_dp=2), "local_dp")])
def test_replicas_of_a_drawing_stage_are_refused(knobs, knob):
    cfg = ParallelConfig(**knobs)
    refusal = draws_refusal(layers(), cfg.balance or (6,), cfg)
    assert isinstance(refusal, ConfigError) and refusal.knob == knob, refusal
    assert "replica" in str(refusal) and "p=0" in str(refusal)
    assert draws_refusal([nn.Identity() if i in (2, 4) else layer for i, layer in enumerate(layers())],
                         cfg.balance or (6,), cfg) is None   # without draws, replicas train as one process
