"""Zero-bubble ZB-V as data: the V placement, the order, its bubble and held activations, the turn, refusals."""

from __future__ import annotations

import doctest

import pytest

from mpi4dl_nb.config import ConfigError, ParallelConfig
from mpi4dl_nb.layout import layout, layout_table, stage_holders
from mpi4dl_nb.pipeline import zero_bubble_v as zero_bubble_v_module
from mpi4dl_nb.pipeline.actions import ActionKind
from mpi4dl_nb.pipeline.schedules import COSTS_SPLIT_EQUAL, build_schedule, one_f_one_b, zb1, zbv
from mpi4dl_nb.pipeline.step_state import channel_pairs, inbound_order
from mpi4dl_nb.pipeline.zero_bubble import ZeroBubbleOp
from mpi4dl_nb.pipeline.zero_bubble_v import zbv_order
from mpi4dl_nb.planner.schedule_replay import replay_schedule

F, IN, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def zbv_cfg(**changes) -> ParallelConfig:
    return ParallelConfig(**{**dict(split_size=4, spatial_size=0, parts=4, schedule="zbv"), **changes})


def test_order_docstring_is_real():
    failures, attempted = doctest.testmod(zero_bubble_v_module, verbose=False)
    assert attempted >= 1 and failures == 0


@pytest.mark.parametrize("positions,m", [(2, 2), (2, 4), (2, 7), (3, 3), (3, 6), (4, 5), (4, 8), (5, 12)])
def test_order_runs_F_I_W_of_both_chunks_once_each_in_turn(positions, m):
    for r in range(positions):
        order = zbv_order(r, positions, m)
        held = (r, 2 * positions - 1 - r)
        assert len(order) == len(set(order)) == 3 * 2 * m
        assert set(order) == {(op, s, u) for op in ZeroBubbleOp for s in held for u in range(m)}
        at = {step: i for i, step in enumerate(order)}
        for s in held:
            for u in range(m):
                assert [at[(op, s, u)] for op in ZeroBubbleOp] == sorted(at[(op, s, u)] for op in ZeroBubbleOp)
            forwards = [step.micro_batch for step in order if step.stage == s and step.op is ZeroBubbleOp.FORWARD]
            assert forwards == list(range(m))


def test_layout_is_a_V_and_a_spatial_first_stage_lends_its_tile_zero_the_last_stage():
    assert [role.stages for role in layout(zbv_cfg(split_size=8, parts=8))] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert zbv_cfg().virtual_stages == 2 and zbv_cfg(virtual_stages=2) == zbv_cfg()
    sp = zbv_cfg(spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2, data_parallel=2)
    roles = layout(sp)
    assert sp.world_size == 6 and [role.stages for role in roles] == [[0, 3], [0], [1, 2]] * 2
    assert stage_holders(sp, 3) == [0, 3] and not roles[0].chunks[0].spatial
    table = layout_table(sp).splitlines()
    assert table[0].split()[-2:] == ["later", "chunks"] and [row.split()[-1] for row in table[2:5]] == ["3", "-", "2"]


def test_the_loss_is_on_rank_0_and_the_turn_stays_on_its_rank():
    schedule = build_schedule(zbv_cfg())
    last = [a for a in schedule.actions(0) if a.kind is F and a.stage == 3]
    assert len(last) == 4       # stage 3 (the loss) runs on rank 0, where stage 0 is
    turn = [a for a in schedule.actions(1) if a.kind.is_p2p and {a.stage} <= {1, 2} and a.peer == 1]
    assert {(a.kind, a.stage) for a in turn} == {(ActionKind.SEND_ACT, 1), (ActionKind.RECV_ACT, 2),
                                                   (ActionKind.SEND_GRAD, 2), (ActionKind.RECV_GRAD, 1)}
    assert channel_pairs(schedule) == [(0, 1), (1, 0)]   # the turn's payloads are no channel, no inbound message
    assert all(src != 1 for src in inbound_order(schedule, 1))


@pytest.mark.parametrize("positions,m", [(2, 4), (3, 6), (4, 8), (3, 9)])
def test_bubble_is_S_minus_1_chunk_ops_per_rank_and_memory_is_1f1b_first_stage_on_every_rank(positions, m):
    """F = I = W, every chunk one unit: a rank idles S-1 chunk ops (half a stage each: half ZB-H1's S-1
    stage ops) and holds 2S chunk activations at most - 1F1B's first stage's S stages - on every rank."""
    run = replay_schedule(zbv(positions, m))
    assert run.busy == (6 * m,) * positions and run.seconds == 6 * m + positions - 1
    assert run.idle_seconds == positions * (positions - 1)
    assert run.peak_held == (2 * positions,) * positions
    first_stage_1f1b = replay_schedule(one_f_one_b(positions, m)).peak_held[0]
    assert run.peak_held[0] / 2 == first_stage_1f1b      # a chunk is half a stage
    assert run.bubble_share == pytest.approx(zbv(positions, m).bubble_share(COSTS_SPLIT_EQUAL))
    assert run.bubble_share < replay_schedule(zb1(positions, m)).bubble_share


def test_acceptance_two_ranks_four_micro_batches():
    """Issue 44 (S=2, m=4, F = I = W): bubble 1/25 of rank-time, 4 chunk activations in flight per rank."""
    run = replay_schedule(zbv(2, 4))
    assert run.bubble_share == pytest.approx(1 / 25) and run.peak_held == (4, 4)
    assert replay_schedule(one_f_one_b(2, 4)).bubble_share == pytest.approx(1 / 5)


def test_table_shows_both_chunks_of_a_rank_and_I_W():
    table = zbv(2, 4).table()
    assert "s0,s3" in table and "s1,s2" in table and "I0@s3" in table and "W3@s0" in table
    assert "B" not in table.replace("AR", "")


@pytest.mark.parametrize("changes,knob", [
    (dict(times=1), "times"),
    (dict(local_dp=2), "local_dp"),
    (dict(sync_batchnorm=True, data_parallel=2), "sync_batchnorm"),
    (dict(parts=1), "parts"),
    (dict(split_size=5), "split_size"),
    (dict(split_size=2), "split_size"),
    (dict(virtual_stages=3, split_size=6), "virtual_stages"),
    (dict(spatial_size=3), "spatial_size"),
])
def test_what_it_cannot_lay_out_or_order_is_refused_with_the_knob(changes, knob):
    with pytest.raises(ConfigError) as info:
        zbv_cfg(**changes)
    assert info.value.knob == knob and "use " in str(info.value) and "zbv" in str(info.value)
