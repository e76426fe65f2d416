"""Schedule-only replay (planner/schedule_replay.py): bubble shares and held activations from the action lists."""

from __future__ import annotations

import doctest
import math

import pytest

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.config import ScheduleKind
from mpi4dl_nb.pipeline.actions import Action, ActionKind
from mpi4dl_nb.pipeline.schedules import (
    COSTS_SPLIT_EQUAL,
    Schedule,
    gems,
    gpipe,
    ideal_bubble_fraction,
    interleaved,
    one_f_one_b,
    zb1,
    zbv,
)
from mpi4dl_nb.planner import schedule_replay
from mpi4dl_nb.planner.schedule_replay import PhaseCosts, held_activations, replay_schedule

UNEQUAL = (PhaseCosts(), PhaseCosts(1.0, 0.5, 0.5), PhaseCosts(1.0, 1.3, 0.7))


def test_doctests_run() -> None:
    failures, attempted = doctest.testmod(schedule_replay, verbose=False)
    assert attempted >= 2 and failures == 0


def test_interleaved_two_ranks_four_micro_batches_bubble_at_most_one_ninth() -> None:
    """Acceptance line of issue 44: S=2, m=4, V=2; the tick table and the replay agree."""
    schedule = interleaved(2, 4, virtual_stages=2)
    replayed = replay_schedule(schedule)
    assert replayed.bubble_share <= 1 / 9 + 1e-12
    assert math.isclose(replayed.bubble_share, schedule.bubble_share(), abs_tol=1e-12)


@pytest.mark.parametrize("positions,micro_batches", [(2, 4), (2, 8), (4, 4), (4, 8)])
@pytest.mark.parametrize("costs", UNEQUAL)
def test_interleaved_bubble_is_megatrons_formula_for_any_forward_backward_ratio(
        positions: int, micro_batches: int, costs: PhaseCosts) -> None:
    """(S-1)/(V*m + S-1) of rank-time, S positions, V chunks each, whatever a backward costs."""
    replayed = replay_schedule(interleaved(positions, micro_batches, virtual_stages=2), costs)
    expected = (positions - 1) / (2 * micro_batches + positions - 1)
    assert math.isclose(replayed.bubble_share, expected, abs_tol=1e-12)
    one_f = replay_schedule(one_f_one_b(positions, micro_batches), costs)
    assert math.isclose(one_f.bubble_share, ideal_bubble_fraction(positions, micro_batches), abs_tol=1e-12)
    assert replayed.bubble_share < one_f.bubble_share


def test_step_seconds_and_busy_time_follow_the_costs() -> None:
    """GPipe S=2, m=2 with F=1, B=3: every rank computes 2*(1+3)=8 s; the step is 8 + the fill (1) and drain (3)."""
    run = replay_schedule(gpipe(2, 2), PhaseCosts(1.0, 2.0, 1.0))
    assert run.busy == (8.0, 8.0)
    assert math.isclose(run.seconds, 12.0)
    assert math.isclose(run.idle_seconds, 8.0)


def test_held_activations_one_f_one_b_holds_fewer_than_gpipe() -> None:
    assert replay_schedule(gpipe(4, 8)).peak_held == (8, 8, 8, 8)
    assert replay_schedule(one_f_one_b(4, 8)).peak_held == (4, 3, 2, 1)
    # chunks of half a stage: position 0 holds its warm-up of 2*(S-1) + (V-1)*S forwards, plus one
    assert replay_schedule(interleaved(4, 8, virtual_stages=2)).peak_held[0] == 2 * 3 + 4 + 1


def test_split_backward_holds_activations_until_the_weight_gradient() -> None:
    F, In, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT

    def act(kind: ActionKind, micro_batch: int) -> Action:
        return Action(kind, rank=0, tick=0, stage=0, micro_batch=micro_batch)

    # I frees nothing: two forwards, both input-gradients, then the weights: two held
    assert held_activations([act(F, 0), act(In, 0), act(F, 1), act(In, 1), act(W, 0), act(W, 1)]) == 2
    assert held_activations([act(F, 0), act(In, 0), act(W, 0), act(F, 1), act(In, 1), act(W, 1)]) == 1


def test_phase_costs_of_each_kind_and_refuse_negative_time() -> None:
    costs = PhaseCosts(1.0, 2.0, 0.5)
    assert costs.of(ActionKind.BACKWARD) == 2.5
    assert (costs.of(ActionKind.BACKWARD_INPUT), costs.of(ActionKind.BACKWARD_WEIGHT)) == (2.0, 0.5)
    assert costs.of(ActionKind.SEND_ACT) == 0.0
    with pytest.raises(ValueError, match="negative"):
        PhaseCosts(forward=-1.0)


def test_zb1_two_ranks_four_micro_batches_idles_a_third_of_1f1b() -> None:
    """Acceptance line of issue 44 for zb1 (S=2, m=4, F = I = W): idle rank-time (S-1) F against 1F1B's 3 (S-1) F.
    As a share of the (shorter) step that is 1/13 against 1/5: 0.38 of 1F1B's share, not a third."""
    split, whole = replay_schedule(zb1(2, 4)), replay_schedule(one_f_one_b(2, 4))
    assert split.idle_seconds <= whole.idle_seconds / 3 + 1e-12
    assert (split.idle_seconds, whole.idle_seconds) == (2.0, 6.0)
    assert math.isclose(split.bubble_share, 1 / 13) and math.isclose(whole.bubble_share, 1 / 5)
    assert split.seconds < whole.seconds


@pytest.mark.parametrize("schedule", [gpipe(3, 4), one_f_one_b(3, 6), gems(2, 2), interleaved(2, 4), interleaved(4, 8),
                                      zb1(2, 4), zb1(3, 6), zb1(4, 8), zbv(2, 4), zbv(3, 6)],
                         ids=lambda s: f"{s.kind}-{s.world_size}")
def test_replay_and_schedule_bubble_share_agree(schedule: Schedule) -> None:
    """The simulator (messages, every rank's list in order) and ``Schedule.bubble_share(costs)`` (the tick
    table's order, dependencies) give one share with the zero-bubble paper's costs."""
    assert math.isclose(replay_schedule(schedule).bubble_share, schedule.bubble_share(COSTS_SPLIT_EQUAL),
                        abs_tol=1e-12)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (3, 6), (4, 8)])
def test_zb1_holds_no_more_activations_than_1f1b_on_its_busiest_rank(stages: int, micro_batches: int) -> None:
    split, whole = replay_schedule(zb1(stages, micro_batches)), replay_schedule(one_f_one_b(stages, micro_batches))
    assert max(split.peak_held) <= max(whole.peak_held) == stages
    assert split.bubble_share < whole.bubble_share


def test_suggest_and_tune_candidates_include_interleaved_zb1_and_zbv() -> None:
    found = planner.candidate_configs(2, 5, 4)
    kinds = {(cfg.schedule, cfg.virtual_stages) for cfg in found}
    assert {(ScheduleKind.INTERLEAVED, 2), (ScheduleKind.ZB1, 1), (ScheduleKind.ZBV, 2),
            (ScheduleKind.ONE_F_ONE_B, 1)} <= kinds
    assert ParallelConfig(split_size=4, spatial_size=0, parts=4, schedule="zbv") in found
    assert ParallelConfig(split_size=2, spatial_size=0, parts=4, schedule="zb1") in found
