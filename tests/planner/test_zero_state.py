"""The memory model under ZeRO (issue 80): each holder's share of the training state as the engine shards it
(uneven last shards), the stages' terms, and the what-fits search and suggest taking the lowest stage that fits."""

from __future__ import annotations

import functools

import pytest
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.config import ScheduleKind
from mpi4dl_nb.pipeline.recompute import segment_bounds
from mpi4dl_nb.planner.memory import MemoryPlan
from mpi4dl_nb.planner.optimizer import TrainingState, shard_numel

SIDE = 8


def layers() -> list[nn.Module]:
    # 140 + 2,247 parameters: the conv's bias (5) and the head's (7) split unevenly over 4 holders
    return [nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(5 * SIDE * SIDE, 7)]


@functools.cache
def plan(zero: int, copies: int = 4) -> MemoryPlan:
    cfg = ParallelConfig(split_size=1, spatial_size=0, data_parallel=copies, zero_stage=zero)
    return planner.estimate_memory(layers(), cfg, SIDE, copies, optimizer_states=2)   # AdamW's 2 states


def test_shards_are_chunks_of_ceil_n_over_holders_the_last_uneven():
    assert [shard_numel(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    assert [shard_numel(2, 4, i) for i in range(4)] == [1, 1, 0, 0]
    for numel in range(0, 23):
        for holders in range(1, 6):
            pieces = [shard_numel(numel, holders, i) for i in range(holders)]
            assert sum(pieces) == numel and pieces == sorted(pieces, reverse=True)


def test_stage_3_on_4_ranks_keeps_a_quarter_of_stage_0s_state():
    whole = plan(0).ranks[0].state_bytes
    count = sum(p.numel() for layer in layers() for p in layer.parameters())
    assert whole == 16 * count                              # 4 weights + 4 gradients + 8 AdamW moments per parameter
    shares = [rank.state_bytes for rank in plan(3).ranks]
    assert sum(shares) == whole                             # the shards tile the state exactly
    assert shares[0] > shares[-1]                           # the last holder's shards are the shorter ones
    assert all(abs(share - whole / 4) <= 16 * 4 for share in shares)   # ceil chunks: within a few elements


def test_each_stage_shards_its_terms_and_no_stage_shards_a_lone_holder():
    count = sum(p.numel() for layer in layers() for p in layer.parameters())
    plans = [plan(zero) for zero in range(4)]
    quarter = plans[3].ranks[0].state["weights"]             # rank 0's shards, 4 bytes an element
    # at levels 1 and 2 the engine keeps the whole weights, its shards their slices (no memory of their own)
    assert plans[1].ranks[0].state == {"weights": 4 * count, "gradients": 4 * count, "optimizer": 2 * quarter}
    assert plans[2].ranks[0].state == {"weights": 4 * count, "gradients": quarter, "optimizer": 2 * quarter}
    states = [p.binding_rank.state_bytes for p in plans]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4
    # level 3 gathers to compute: a layer and its neighbour, here the stage's only two layers with weights
    assert [p.binding_rank.terms["gathered"] for p in plans] == [0, 0, 0, 4 * count]
    alone = [plan(zero, copies=1) for zero in range(4)]
    assert len({p.peak for p in alone}) == 1 and alone[0].ranks[0].state_bytes == 16 * count


def test_suggest_takes_the_lowest_zero_stage_that_fits():
    from mpi4dl_nb.planner.suggest import _by_memory, _StepEstimate, canonical

    step = _StepEstimate(planner.profile_layers(layers(), SIDE), SIDE, 4, planner.Precision(), None,
                         planner.memory.default_loss, None, 2)
    cfg = ParallelConfig(split_size=1, spatial_size=0, data_parallel=4)
    limit = (plan(2).peak + plan(1).peak) / 2                # between stage 2's peak and stage 1's
    fitting, refused = _by_memory(step, [cfg], limit, 0.0, (0, 1, 2, 3))
    assert [c.zero_stage for c, _ in fitting] == [2] and not refused
    fitting, refused = _by_memory(step, [cfg], limit, 0.0)   # stage 0 only: refused
    assert not fitting and refused[0].cfg.zero_stage == 0
    assert canonical(ParallelConfig(split_size=1, spatial_size=0, zero_stage=3)).zero_stage == 0   # nothing shared


@pytest.mark.parametrize("zero", [0, 3])
def test_layout_state_table_prints_each_stages_state(zero: int):
    from mpi4dl_nb.cli.stage_table import state_table

    cfg = ParallelConfig(split_size=1, spatial_size=0, data_parallel=4, zero_stage=zero)
    lines = state_table(layers(), cfg, SIDE, 2).splitlines()
    header, row = lines[1].split(), lines[3].split()
    assert header[3 + zero].endswith("*")
    cells = [float(cell) for cell in row[3:7]]
    count = sum(p.numel() for layer in layers() for p in layer.parameters())
    assert row[1] == "4" and cells[0] == round(16 * count / 2 ** 20, 3)
    assert cells[0] / 4 == pytest.approx(cells[3], abs=0.001)


def deep() -> list[nn.Module]:
    # 208, 544, 1,056 and 66 parameters in the layers with weights (units 0-3); the largest neighbours: units 1, 2
    return [nn.Flatten(), nn.Linear(12, 16), nn.Linear(16, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2)]


def stage_3(setting: str | int | None) -> tuple[int, int]:
    """Level 3 of ``deep()`` on 2 holders, holder 0: the planner's (gathered, gather), and the engine's most bytes of
    whole weights present at once over a forward and backward (``ShardedStage.peak_bytes``, the hooks of
    sharding/layer_units.py)."""
    import torch

    from mpi4dl_nb.comm.handles import Group
    from mpi4dl_nb.pipeline.recompute import checkpointed
    from mpi4dl_nb.planner.fake_world import FakeComm
    from mpi4dl_nb.sharding.layer_units import gather_layer_by_layer
    from mpi4dl_nb.sharding.sharded_stage import ShardedStage

    torch.manual_seed(0)
    model = nn.Sequential(*deep())
    cfg = ParallelConfig(split_size=1, spatial_size=0, data_parallel=2, zero_stage=3, checkpoint_activations=setting)
    segments = None if setting is None else (lambda stage: segment_bounds(len(model), setting))
    state = TrainingState(cfg, [list(model)], optimizer_states=2, segments=segments).of(0, 0)
    stage = ShardedStage(FakeComm(0, None, torch.device("cpu"), world_size=2), 0, list(model.named_parameters()),
                         Group((0, 1)), 3, lambda: ())
    run = model if setting is None else checkpointed(model, setting)
    assert gather_layer_by_layer(stage, run)
    run(torch.randn(4, 3, 2, 2)).square().sum().backward()
    assert state.gathered == stage.peak_bytes, (state, stage.peak_bytes)
    return state.gathered, state.gather


@pytest.mark.parametrize("setting", [None, "every", 4])
def test_stage_3_gathers_what_the_engine_gathers_layer_by_layer(setting):
    gathered, gather = stage_3(setting)
    whole = 4 * sum(p.numel() for layer in deep() for p in layer.parameters())
    if setting == 4:   # one segment holds units 0-2, present together from their recomputed forward on
        assert gathered == 4 * (208 + 544 + 1056) < whole
    else:              # units 1 and 2: a layer and the one it prefetches
        assert gathered == 4 * (544 + 1056) < whole
    # beside them the all-gather of the largest unit: its flat buffer and this holder's piece (ceil chunks)
    assert gather == 4 * (1056 + shard_numel(1024, 2, 0) + shard_numel(32, 2, 0))


def test_stage_3_gathers_the_whole_stage_where_the_engine_does():
    whole = 4 * sum(p.numel() for layer in deep() for p in layer.parameters())
    shared, twin = deep(), nn.Linear(32, 32)
    twin.weight = shared[3].weight            # two layers share a weight: the engine gathers the stage whole
    cfg = ParallelConfig(split_size=1, spatial_size=0, data_parallel=2, zero_stage=3)
    held = TrainingState(cfg, [[*shared, twin]], optimizer_states=2).of(0, 0)
    assert held.gathered == held.whole_gradients > whole
    # zero-bubble: stage 1 runs I and W apart (gathered whole), stage 0 does not split (layer by layer)
    zb = ParallelConfig(split_size=2, spatial_size=0, data_parallel=2, zero_stage=3, schedule=ScheduleKind.ZB1,
                        parts=2)
    state = TrainingState(zb, [deep(), deep()], optimizer_states=2)
    assert state.of(0, 1).gathered == whole and state.of(0, 0).gathered == 4 * (544 + 1056)


@pytest.mark.parametrize("setting", [None, "every", 4])
def test_stage_3_peak_counts_what_the_engine_gathers_beside_backward(setting):
    # 128 samples a copy: the backward peaks (not the reduce-scatter), with the gathered layers beside it
    cfg = ParallelConfig(split_size=1, spatial_size=0, data_parallel=2, zero_stage=3, checkpoint_activations=setting)
    peak = planner.estimate_memory(deep(), cfg, 2, 256, optimizer_states=2).ranks[0]
    assert "backward" in peak.moment and peak.terms["gathered"] == stage_3(setting)[0]
