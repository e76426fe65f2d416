"""The interleaved schedule as data: Megatron's order, the chunks' placement, its bubble, its refusals."""

from __future__ import annotations

import doctest

import pytest

from mpi4dl_nb.cli.stage_table import stage_table
from mpi4dl_nb.config import ConfigError, ParallelConfig
from mpi4dl_nb.layout import layout, layout_table, stage_holders
from mpi4dl_nb.pipeline import interleaved as interleaved_module
from mpi4dl_nb.pipeline.actions import ActionKind
from mpi4dl_nb.pipeline.interleaved import interleaved_order
from mpi4dl_nb.pipeline.schedules import build_schedule, interleaved, one_f_one_b
from mpi4dl_nb.planner.simulate import Cost, simulate
from tests.support.models import build


def interleaved_cfg(**changes) -> ParallelConfig:
    knobs = dict(split_size=4, spatial_size=0, parts=4, schedule="interleaved", virtual_stages=2)
    return ParallelConfig(**{**knobs, **changes})


def test_order_docstring_is_real():
    failures, attempted = doctest.testmod(interleaved_module, verbose=False)
    assert attempted >= 1 and failures == 0


@pytest.mark.parametrize("positions,chunks,m", [(2, 2, 4), (4, 2, 8), (3, 3, 6), (2, 3, 2)])
def test_order_runs_every_chunk_of_every_micro_batch_once_forward_then_backward(positions, chunks, m):
    for p in range(positions):
        order = interleaved_order(p, positions, chunks, m)
        held = {p + c * positions for c in range(chunks)}
        assert sorted((op.forward, op.stage, op.micro_batch) for op in order) == sorted(
            (f, s, u) for f in (False, True) for s in held for u in range(m))
        position = {(op.forward, op.stage, op.micro_batch): i for i, op in enumerate(order)}
        assert all(position[(True, s, u)] < position[(False, s, u)] for s in held for u in range(m))
        # micro-batches enter each chunk in order, in groups of `positions`
        firsts = [op.micro_batch for op in order if op.forward and op.stage == p]
        assert firsts == list(range(m))


def test_order_refuses_micro_batches_not_in_groups_of_positions():
    with pytest.raises(ValueError, match="groups of 2"):
        interleaved_order(0, 2, 2, 3)


def test_layout_places_non_consecutive_chunks_and_a_spatial_first_stage_on_tile_zero():
    plain = layout(interleaved_cfg(split_size=8))
    assert [role.stages for role in plain] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    sp = interleaved_cfg(spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2,
                         data_parallel=2)
    assert sp.world_size == 6 and "split_size 4 / virtual_stages 2" in sp.describe_world()
    roles = layout(sp)
    assert [role.stages for role in roles] == [[0, 2], [0], [1, 3]] * 2
    assert roles[0].primary.spatial and not roles[0].chunks[0].spatial
    assert stage_holders(sp, 2) == [0, 3] and stage_holders(sp, 0) == [0, 1, 3, 4]
    table = layout_table(sp).splitlines()
    assert table[0].split()[-2:] == ["later", "chunks"] and table[2].split()[-1] == "2"


def test_every_rank_computes_only_the_stages_it_holds():
    cfg = interleaved_cfg(split_size=6, virtual_stages=3, parts=4, data_parallel=2)
    schedule = build_schedule(cfg)
    for role in layout(cfg):
        ran = {a.stage for a in schedule.actions(role.rank) if a.kind.is_compute}
        reduced = [a.stage for a in schedule.actions(role.rank) if a.kind is ActionKind.ALLREDUCE]
        assert sorted(ran) == role.stages == reduced


def unit_chunk_costs(virtual_stages: int):
    """Every chunk 1/V of an equal stage: forward and backward one time unit per whole stage."""
    def cost(action):
        return Cost(1.0 / virtual_stages) if action.kind.is_compute else Cost()
    return cost


def simulated_bubble(schedule, virtual_stages: int) -> float:
    ranks = simulate(schedule, unit_chunk_costs(virtual_stages), lambda a: 0.0)
    end = max(r.end for r in ranks)
    return sum(end - r.compute for r in ranks) / (end * len(ranks))


def test_bubble_share_for_two_ranks_four_micro_batches_is_at_most_one_ninth():
    schedule = interleaved(2, 4, virtual_stages=2)
    assert schedule.bubble_share() <= 1 / 9
    assert simulated_bubble(schedule, 2) <= 1 / 9 + 1e-12
    baseline = one_f_one_b(2, 4)
    assert baseline.bubble_share() == pytest.approx(1 / 5)      # (S-1)/(m+S-1): what interleaving beats
    assert simulated_bubble(baseline, 1) == pytest.approx(1 / 5)


@pytest.mark.parametrize("positions,m,v", [(2, 8, 2), (4, 4, 2), (4, 8, 2), (2, 4, 3)])
def test_bubble_share_is_megatrons(positions, m, v):
    """(S-1)/(V m + S-1) with equal chunks: the warm-up and drain shrink V times."""
    assert interleaved(positions, m, v).bubble_share() <= (positions - 1) / (v * m + positions - 1) + 1e-12


@pytest.mark.parametrize("changes,knob", [
    (dict(schedule="1f1b"), "virtual_stages"),
    (dict(virtual_stages=1), "virtual_stages"),
    (dict(split_size=5), "virtual_stages"),
    (dict(split_size=2), "virtual_stages"),
    (dict(parts=3), "parts"),
    (dict(spatial_size=3, split_size=4), "spatial_size"),
    (dict(times=1), "times"),
    (dict(local_dp=2), "local_dp"),
    (dict(sync_batchnorm=True, data_parallel=2), "sync_batchnorm"),
])
def test_what_it_cannot_lay_out_or_order_is_refused_with_the_knob(changes, knob):
    with pytest.raises(ConfigError) as info:
        interleaved_cfg(**changes)
    assert info.value.knob == knob and "use " in str(info.value)


def test_stage_table_names_each_chunks_ranks():
    cfg = interleaved_cfg(spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2,
                          balance=(2, 1, 1, 1))
    rows = stage_table(build("resnet"), cfg, 16).splitlines()[2:6]
    assert [row.split()[:3] for row in rows] == [["0", "spatial", "0-1"], ["1", "layer", "2"],
                                                 ["2", "layer", "0"], ["3", "layer", "2"]]


def test_planner_estimates_each_rank_with_its_chunks():
    from mpi4dl_nb import planner
    from mpi4dl_nb.models import build_model
    from tests.planner.recording import flop_timer

    layers = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
    profiles = planner.profile_layers(layers, 64)
    cfg = interleaved_cfg()
    memory = planner.estimate_memory(profiles, cfg, 64, 4)
    starts = [sum(memory.balance[:s]) for s in range(cfg.split_size + 1)]
    for rank, role in zip(memory.ranks, layout(cfg)):
        held = [p for s in role.stages for p in profiles[starts[s]:starts[s + 1]]]
        assert rank.weights == sum(p.param_bytes for p in held) > 0
    plan = planner.predict_step_time(layers, cfg, 64, 4, timer=flop_timer(),
                                     node=planner.Node(cores=None, copy_bandwidth=1e12),
                                     network=planner.Network(1e-4, 1e9))
    assert plan.seconds > 0 and 0 < plan.idle_fraction < 1


def test_tune_and_suggest_consider_interleaving():
    from mpi4dl_nb import planner

    found = planner.candidate_configs(2, 5, 4)
    want = interleaved_cfg(parts=4)
    assert want in found and interleaved_cfg(parts=2) in found
    assert planner.describe_config(want) == "LP 4 stages + 4 micro-batches (interleaved) + 2 chunks per rank"
    assert all(c.world_size == 2 for c in found)
