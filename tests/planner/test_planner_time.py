"""Planner time model and suggest: the schedule replayed in simulated time (bubbles, messages,
shared cores, tile groups), the network fit, predicted step times, canonical candidates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.measure.calibration import CrowdedRounds, JobCalibration
from mpi4dl_nb.models import build_model
from mpi4dl_nb.pipeline.actions import ActionKind
from mpi4dl_nb.pipeline.schedules import build_schedule, stage_ranks
from mpi4dl_nb.planner.crowding import Crowding
from mpi4dl_nb.planner.device import LayerTime
from mpi4dl_nb.planner.layer_timer import LayerTimer
from mpi4dl_nb.planner.simulate import Cost, group_key, simulate
from mpi4dl_nb.planner.suggest import HEADROOM, one_knob_variants
from tests.planner.recording import RecordingDevice, flop_timer, flops
from tests.support.battery import shared_job

CALIBRATION = shared_job(3, "calibration", timeout=120)


def unit_costs(cfg, forward=1.0, backward=2.0, lockstep=False, exposed=1.0):
    holders = stage_ranks(cfg)

    def cost(action):
        if action.kind is ActionKind.FORWARD or action.kind is ActionKind.BACKWARD:
            work = forward if action.kind is ActionKind.FORWARD else backward
            if action.stage < cfg.spatial_size:
                ranks = holders[(action.dp, action.replica, action.stage)]
                return Cost(work, 0.0, group_key(action, ranks, "tiles"), len(ranks), lockstep=lockstep,
                            exposed=exposed)
            return Cost(work)
        return Cost()
    return cost


def test_simulated_gpipe_is_the_bubble_formula_and_messages_add_latency():
    cfg = ParallelConfig(split_size=2, spatial_size=0, parts=2)
    ends = simulate(build_schedule(cfg), unit_costs(cfg), lambda a: 0.0)
    assert max(t.end for t in ends) == pytest.approx((2 + 2 - 1) * 3.0)     # (m + S - 1)(F + B)
    assert sum(t.waiting for t in ends) == pytest.approx(2 * 9.0 - 2 * 2 * 3.0)
    lp = ParallelConfig(split_size=2, spatial_size=0)
    ends = simulate(build_schedule(lp), unit_costs(lp), lambda a: 0.5)
    assert max(t.end for t in ends) == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_each_rank_s_phases_tile_its_step_and_waits_count_in_the_action_that_waits():
    lp = ParallelConfig(split_size=2, spatial_size=0)
    ranks = simulate(build_schedule(lp), unit_costs(lp), lambda a: 0.5, start=lambda r: 0.25 * r)
    first, second = (t.phases for t in ranks)
    # stage 1 waits from its set-up (0.25) for stage 0's forward (1) and the message (0.5)
    assert second["RECV_ACT"] == pytest.approx(1.5 - 0.25)
    assert second["F"] == pytest.approx(1.0) and second["B"] == pytest.approx(2.0)
    # stage 0 waits from its forward's end (1) for the gradient: stage 1 runs F + B (3), then the wire (0.5)
    assert first["RECV_GRAD"] == pytest.approx(1.5 + 3.0 + 0.5 - 1.0) and first["SEND_ACT"] == 0.0
    for rank, timeline in enumerate(ranks):     # from each rank's set-up to its end, nothing left out
        assert 0.25 * rank + sum(timeline.phases.values()) == pytest.approx(timeline.end)
    sp = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical")
    base = unit_costs(sp)

    def late_tile(action):      # tile 1 starts 1 s late: tile 0's forward waits for it in the group
        c = base(action)
        return Cost(c.work, 0.25 if c.group else 0.0, c.group, c.members)
    tiles = simulate(build_schedule(sp), late_tile, lambda a: 0.0, start=lambda r: 1.0 if r == 1 else 0.0)
    assert tiles[0].phases["F"] == pytest.approx(1.0 + 1.0 + 0.25) and tiles[1].phases["F"] == pytest.approx(1.25)
    assert all(sum(t.phases.values()) + (1.0 if t.rank == 1 else 0.0) == pytest.approx(t.end) for t in tiles)


def test_ranks_sharing_cores_slow_each_other_and_tiles_run_as_a_group():
    dp = ParallelConfig(split_size=1, spatial_size=0, data_parallel=2)
    alone = simulate(build_schedule(dp), unit_costs(dp), lambda a: 0.0, cores=None)
    shared = simulate(build_schedule(dp), unit_costs(dp), lambda a: 0.0, cores=1)
    assert max(t.end for t in alone) == pytest.approx(3.0)
    assert max(t.end for t in shared) == pytest.approx(6.0)
    sp = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical")
    holders = stage_ranks(sp)
    base = unit_costs(sp)

    def uneven(action):      # tile 1 is twice as slow: both tiles finish together
        c = base(action)
        return Cost(c.work * (2 if action.rank == 1 and c.group else 1), 0.25 if c.group else 0.0,
                    c.group, c.members)
    ends = simulate(build_schedule(sp), uneven, lambda a: 0.0)
    assert holders[(0, 0, 0)] == (0, 1)
    assert ends[0].end == pytest.approx(ends[1].end)
    assert max(t.end for t in ends) == pytest.approx(2 + 0.25 + 1 + 2 + 4 + 0.25)


def test_network_fit_recovers_latency_and_bandwidth():
    points = [(n, 30e-6 + n / 2e9) for n in (1024, 65536, 1 << 20, 8 << 20)]
    net = planner.fit_network(points)
    assert net.latency == pytest.approx(30e-6, rel=1e-3) and net.bandwidth == pytest.approx(2e9, rel=1e-3)
    assert net.all_reduce(1000, 1) == 0 and net.all_reduce(4e6, 4) > net.message(1e6)
    assert planner.fit_network([]) == planner.Network()


FlopTimer = flop_timer   # deterministic layer "times" (tests/planner/recording.py), nothing measured


@pytest.fixture(scope="module")
def resnet():
    return build_model("resnet", num_layers=11, num_filters=8, num_classes=2)


def test_predicted_time_adds_layers_schedule_and_network(resnet):
    timer, node, net = FlopTimer(), planner.Node(cores=None, copy_bandwidth=1e12), planner.Network(1e-4, 1e9)
    serial = planner.predict_step_time(resnet, ParallelConfig(split_size=1, spatial_size=0), 64, 2,
                                       timer=timer, node=node, network=net)
    layer_sum = sum(t.forward + t.backward for t in timer._found.values())
    assert serial.seconds == pytest.approx(layer_sum, rel=0.01)
    lp = planner.predict_step_time(resnet, ParallelConfig(split_size=2, spatial_size=0), 64, 2,
                                   timer=timer, node=node, network=net)
    assert lp.seconds > serial.seconds and lp.idle_fraction > 0.3 and "bubble" in lp.binding()
    gpipe = planner.predict_step_time(resnet, ParallelConfig(split_size=2, spatial_size=0, parts=2), 64, 2,
                                      timer=timer, node=node, network=net)
    assert gpipe.seconds < lp.seconds and gpipe.handoff_bytes > 0
    sp = planner.predict_step_time(resnet, ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4),
                                   64, 2, timer=timer, node=node, network=net)
    assert sp.halo_seconds > 0 and sp.images_per_second == pytest.approx(2 / sp.seconds)


def test_meetings_of_ranks_sharing_cores_cost_sync_each(resnet):
    """Every halo exchange and collective of a tile group costs ``Crowding.sync`` more while
    more ranks compute than there are cores - in its meeting cost (``meeting_extra``) when the
    tiles themselves outnumber the cores; with a core per computing rank, or without a tile
    group, nothing changes. (No wire time: the tiles compute all their time, so each counts as a
    whole rank on the cores.)"""
    timer = FlopTimer()
    plain, meeting = planner.Network(0.0, 1e30), planner.Network(0.0, 1e30, crowding=Crowding(sync=1e-3))

    def extra(cfg, cores):
        node = planner.Node(cores=cores, copy_bandwidth=1e12)
        base = planner.predict_step_time(resnet, cfg, 64, 2, timer=timer, node=node, network=plain)
        slow = planner.predict_step_time(resnet, cfg, 64, 2, timer=timer, node=node, network=meeting)
        return slow.seconds - base.seconds

    sp4 = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)
    crowded = extra(sp4, cores=2)            # 4 of the 5 ranks on 2 cores: a meeting pays 2/3 of 1 ms
    meetings = crowded / (2 / 3 * 1e-3)
    assert meetings == pytest.approx(round(meetings)) and round(meetings) >= 10
    assert extra(sp4, cores=1) / meetings == pytest.approx(3 / 4 * 1e-3)    # 4 ranks, 3 beyond 1 core of 4
    assert extra(sp4, cores=4) == pytest.approx(0.0, abs=1e-12)
    assert extra(sp4, cores=None) == pytest.approx(0.0, abs=1e-12)
    sp2 = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical")
    assert extra(sp2, cores=2) == pytest.approx(0.0, abs=1e-12)   # the LP rank waits meanwhile
    assert extra(sp2, cores=1) > 0
    assert extra(ParallelConfig(split_size=2, spatial_size=0), cores=1) == pytest.approx(0.0, abs=1e-12)
    assert "per meeting" in meeting.describe() and "per meeting" not in plain.describe()
    always = planner.Network(0.0, 1e30, meeting=1e-3)      # a meeting costs this crowded or not
    node = planner.Node(cores=None, copy_bandwidth=1e12)
    base = planner.predict_step_time(resnet, sp2, 64, 2, timer=timer, node=node, network=plain).seconds
    assert planner.predict_step_time(resnet, sp2, 64, 2, timer=timer, node=node, network=always).seconds > \
        base + 10e-3


def test_a_meeting_costs_a_pair_s_while_each_tile_has_a_core_and_rises_to_the_crowd_s_beyond():
    crowd = Crowding(sync=1.2e-3, crowd_members=5)
    assert crowd.meeting_extra(2, 1e-3, cores=2, ranks=5) == 0.0
    assert crowd.meeting_extra(4, 1e-3, cores=4, ranks=5) == 0.0          # a core each
    assert crowd.meeting_extra(4, 1e-3, cores=2, ranks=5) == pytest.approx(1.2e-3 * 2 / 3)
    assert crowd.meeting_extra(5, 1e-3, cores=2, ranks=5) == pytest.approx(1.2e-3)   # the crowd as measured
    assert crowd.meeting_extra(9, 1e-3, cores=2, ranks=9) == pytest.approx(1.2e-3)   # never beyond it
    unknown = Crowding(sync=1.2e-3)                 # crowd's ranks: the configuration's
    assert unknown.meeting_extra(4, 1e-3, cores=2, ranks=8) == pytest.approx(1.2e-3 * 2 / 6)
    calibration = JobCalibration(((4, 1e-4), (1 << 20, 1e-3)), 2e-4, 1, "cpu", 0.0, 5, CrowdedRounds(1.4e-3, 1e-3))
    network = planner.network_of(calibration)
    assert network.meeting == 2e-4 and network.crowding.crowd_members == 5
    assert network.crowding.sync == pytest.approx(1.2e-3) and network.crowding.sync_short == pytest.approx(0.8e-3)
    uncrowded = planner.network_of(dataclasses.replace(calibration, crowded=None))    # the rounds did not run
    assert uncrowded.crowding == Crowding() and uncrowded.meeting == 2e-4


def test_a_batchnorm_sum_s_latency_is_in_its_meeting_not_again_on_the_wire(resnet):
    from mpi4dl_nb.planner.step_time import step_model

    sp = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical")
    found = step_model(resnet, sp, 64, 2, timer=FlopTimer(), node=planner.Node(cores=None, copy_bandwidth=1e12),
                       network=planner.Network(latency=1e-3, bandwidth=1e30))
    costs = found.costs
    first, last = costs.model.bounds[0], costs.model.bounds[1]
    traffic = [costs.layer_time(0, i, 0)[1].forward_traffic for i in range(first, last)]
    assert sum(t.collectives for t in traffic) > 0 and sum(t.messages for t in traffic) > 0
    assert costs.stage(0, 0)[1] == pytest.approx(sum(t.messages for t in traffic) * 1e-3 / 2)   # the halo messages'


def test_crowded_meeting_cost_follows_the_work_between_meetings():
    net = Crowding(sync=2e-3, sync_short=0.5e-3, sync_work=1e-3, short_work=0.25e-3)
    assert net.crowded_meeting(5e-3) == 2e-3 and net.crowded_meeting(1e-3) == 2e-3
    assert net.crowded_meeting(0.1e-3) == 0.5e-3 and net.crowded_meeting(0.25e-3) == 0.5e-3
    assert net.crowded_meeting(0.625e-3) == pytest.approx(1.25e-3)
    assert Crowding(sync=2e-3).crowded_meeting(1e-6) == 2e-3       # one measurement: constant


def test_layer_times_use_the_ranks_threads_when_given(resnet):
    from mpi4dl_nb.planner import step_time

    node = planner.Node(cores=2, copy_bandwidth=1e12)
    small = build_model("resnet", num_layers=11, num_filters=4, num_classes=2)
    cfg = ParallelConfig(split_size=1, spatial_size=0)
    step_time.DEFAULT_TIMERS.clear()
    planner.predict_step_time(small, cfg, 16, 1, node=node)
    planner.predict_step_time(small, cfg, 16, 1, node=node, threads=1)
    assert sorted(key[2] for key in step_time.DEFAULT_TIMERS) == [1, 2]   # dl.init's split, then as given


def test_suggest_lists_each_run_once_fastest_first_and_says_what_binds(resnet):
    timer, node = FlopTimer(), planner.Node(cores=2, copy_bandwidth=1e10)
    one = planner.estimate_memory(resnet, ParallelConfig(split_size=1, spatial_size=0), 64, 2).peak
    found = planner.suggest(resnet, 64, 0.9 * one, 5, batch_size=2, top=None, timer=timer, node=node)
    cfgs = [s.cfg for s in found]
    assert len(set(cfgs)) == len(cfgs) and all(planner.canonical(c) == c for c in cfgs)
    assert all(s.world_size == 5 and s.peak_bytes <= 0.9 * one for s in found)
    assert [s.est_step_time for s in found] == sorted(s.est_step_time for s in found)
    for s in found:
        text = s.describe()
        assert "spatial 0" not in text and "x 4 square" not in text and "binds" not in text
        assert "time bound by" in text and "MB" in text
        if s.cfg.spatial_size == 0:
            assert (s.cfg.num_spatial_parts, str(s.cfg.slice_method)) == (4, "square")
    assert all(r.memory.peak > 0.9 * one * (1 - HEADROOM) and "needs" in r.describe() for r in found.refused)
    assert found.serial_memory.peak == one and "one process" in found.table()
    close = found.toss_up()
    times = [s.est_step_time for s in found]
    assert close == sum(t <= 1.1 * times[0] for t in times) >= 1
    assert ("predicted within 10% of each other" in found.table()) == (close > 1)
    assert close > 1        # mirror images (1x2 and 2x1 tiles of a square image) predict alike
    assert found.toss_up(within=1e9) == len(found) and type(found)([]).toss_up() == 0
    # one stage on two ranks is data parallelism whichever knob says so: listed once
    two = planner.candidate_configs(2, 5, 2)
    assert ParallelConfig(split_size=1, spatial_size=0, data_parallel=2) in two
    assert not any(c.split_size == 1 and c.local_dp > 1 for c in two)
    with pytest.raises(ValueError, match="raise devices or memory_per_device"):
        planner.suggest(resnet, 64, one / 1000, 2, batch_size=2, timer=timer)


def test_suggest_leaves_headroom_below_the_limit_for_the_estimate_s_error(resnet):
    timer, node = FlopTimer(), planner.Node(cores=2, copy_bandwidth=1e10)
    every = planner.suggest(resnet, 64, 1e12, 5, batch_size=2, top=None, timer=timer, node=node, headroom=0)
    peaks = sorted(s.peak_bytes for s in every)
    limit = peaks[len(peaks) // 2] / (1 - HEADROOM / 2)    # the middle candidate: within the headroom
    found = planner.suggest(resnet, 64, limit, 5, batch_size=2, top=None, timer=timer, node=node)
    exact = planner.suggest(resnet, 64, limit, 5, batch_size=2, top=None, timer=timer, node=node, headroom=0)
    budget = limit * (1 - HEADROOM)
    assert all(s.peak_bytes <= budget for s in found) and all(s.peak_bytes <= limit for s in exact)
    within = [r for r in found.refused if r.memory.peak <= limit]        # fit the limit, not the headroom
    assert within and all("8% headroom" in r.describe() for r in within)
    assert {s.cfg for s in exact} == {s.cfg for s in found} | {r.cfg for r in within}
    assert all("headroom" not in r.describe() for r in exact.refused)
    with pytest.raises(ValueError, match="headroom=1.0"):
        planner.suggest(resnet, 64, limit, 5, batch_size=2, headroom=1.0)


def test_one_knob_variants_change_exactly_one_knob_on_the_same_ranks():
    from dataclasses import fields

    base = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)
    variants = one_knob_variants(base, 5, 2)
    assert {(k, str(v)) for k, v, _ in variants} >= {("parts", "2"), ("slice_method", "vertical"),
                                                      ("halo_d2", "True")}
    assert len({c for _, _, c in variants}) == len(variants) and base not in [c for _, _, c in variants]
    for knob, value, cfg in variants:
        changed = [f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(base, f.name)]
        assert changed == [knob] and getattr(cfg, knob) == value and cfg.world_size == base.world_size
    # a schedule with one micro-batch changes nothing: not a variant
    assert "schedule" not in [k for k, _, _ in variants]


def test_tuner_measures_suggest_order_and_a_one_knob_sweep_and_picks_the_fastest_that_fits():
    from mpi4dl_nb.measure import trials
    from mpi4dl_nb.planner.tune import Tuner

    spec = trials.ModelSpec("resnet", 11, 8)
    layers = spec.build()
    one = planner.estimate_memory(layers, ParallelConfig(split_size=1, spatial_size=0), 32, 2).peak
    calls = []
    rows = []

    def fake_run(function, *args):   # stands in for the ranks: each timed round faster than the last
        calls.append(function)
        if function is trials.calibrate_job_on_engine:
            return JobCalibration(((0, 1e-5), (1 << 20, 1e-3)), 1e-4, 1, "cpu", 0.0, 3, CrowdedRounds(3e-4, 2e-4))
        if function is trials.build_trials_on_engine:
            rows[:] = args[1]
            return [(int(0.5 * one),) * 3 for _ in rows]
        if function is trials.time_trials_on_engine:
            seconds = 1.0 / len(calls)    # the last row fastest within a round: calls count up
            return [(seconds * (len(rows) - i),) * args[0] for i in range(len(rows))]
        if function is trials.trial_phases_on_engine:    # every rank's traced phases: F 0.125 s, the rest waiting
            assert args == (1,)            # the warm pass left out
            return [tuple({"F": 0.125, "RECV_GRAD": 0.5} for _ in range(3)) for _ in rows]
        return None

    tuner = Tuner(spec, 32, 2, 0.9 * one, 3, fake_run, top=2, steps=1,
                  suggest_options=dict(timer=FlopTimer(), node=planner.Node(cores=2, copy_bandwidth=1e10)))
    result = tuner()
    assert calls == [trials.calibrate_job_on_engine, trials.build_trials_on_engine, trials.time_trials_on_engine,
                     trials.time_trials_on_engine, trials.trial_phases_on_engine, trials.release_trials_on_engine]
    assert rows[0] is None and rows[1:] == [s.cfg.as_dict() for s in result.suggestions]   # all built together
    assert tuner.threads == 1 and tuner.device == "cpu" and result.network.crowding.sync == pytest.approx(2e-4)
    assert result.network.meeting == pytest.approx(1e-4) and result.network.crowding.sync_short == pytest.approx(1e-4)
    assert [r.cfg for r in result.candidates] == [s.cfg for s in result.suggestions]
    assert result.best is result.rows[-1] and "picked" in result.table()
    assert all(r.ratio is not None for r in result.rows)
    explained = result.explain().split("\n\n")      # a block per candidate: header, a line per rank, the gap
    assert len(explained) == len(result.candidates)
    for block, row in zip(explained, result.candidates):
        lines = block.splitlines()
        assert lines[0].startswith(f"{row.label}: {row.predicted_seconds:.3f} s predicted")
        assert lines[1].split()[0] == "rank" and "F" in lines[1].split() and lines[1].split()[-1] == "sum"
        assert [line.split()[0] for line in lines[2:5]] == ["0", "1", "2"]
        first = row.plan.ranks[0].phases
        assert lines[2].split()[lines[1].split().index("F")] == f"{first['F']:.3f}/0.125"
        assert lines[5].startswith("largest gap: rank ")
    sweep = tuner.sweep(ParallelConfig(split_size=3, spatial_size=0), result.network, knobs=("parts", "times"))
    assert [r.label for r in sweep.rows] == ["one process", "LP 3 stages", "parts=2", "times=1"]
    calls.clear()
    tuner.rounds, tuner.steps = 2, 3     # two timed rounds of 3 steps each, after the warm round
    shown = []
    tuner.measure_all(sweep, lambda r: shown.append([row.measured.seconds for row in r.rows]))
    count = len(sweep.rows)
    assert calls == [trials.build_trials_on_engine, trials.time_trials_on_engine] + [
        trials.time_trials_on_engine, trials.trial_phases_on_engine] * 2 + [trials.release_trials_on_engine]
    assert len(shown) == 2 and "first choice" not in sweep.table()
    # each row: the median of its 6 steps - 3 from the round at call 3, 3 from the round at call 5
    assert shown[-1] == pytest.approx([(count - i) * (1 / 3 + 1 / 5) / 2 for i in range(count)])
    assert all(len(row.measured.step_seconds) == 6 for row in sweep.rows)


def test_job_calibration_on_three_ranks(shared_launch):
    from tests.mpi.calibration import CHECKS

    shared_launch(CALIBRATION).require_clean(CHECKS)


def test_computing_beside_waiting_ranks_is_slower_in_proportion_to_them():
    def end(cfg, **kw):
        return max(t.end for t in simulate(build_schedule(cfg), unit_costs(cfg), lambda a: 0.0, **kw))

    lp = ParallelConfig(split_size=2, spatial_size=0)
    assert end(lp, cores=2) == pytest.approx(6.0)
    assert end(lp, cores=2, waiting_slowdown=2.0) == pytest.approx(12.0)   # one computes, the other waits
    assert end(lp, cores=None, waiting_slowdown=2.0) == pytest.approx(6.0)  # a device each: no shared core
    dp = ParallelConfig(split_size=1, spatial_size=0, data_parallel=2)     # both always compute: no change
    assert end(dp, cores=2, waiting_slowdown=2.0) == pytest.approx(3.0)
    lp4 = ParallelConfig(split_size=4, spatial_size=0)    # measured with 2 computing + 2 waiting on 2 cores
    base = end(lp4, cores=2)
    assert end(lp4, cores=2, waiting_slowdown=1.5) == pytest.approx(1.5 * base)   # 3 wait: capped at 1.5x


def test_tiles_in_lockstep_are_stalled_by_every_member_s_interruptions_while_each_has_a_core():
    def end(cfg, lockstep, exposed=1.0, **kw):
        costs = unit_costs(cfg, lockstep=lockstep, exposed=exposed)
        return max(t.end for t in simulate(build_schedule(cfg), costs, lambda a: 0.0, **kw))

    sp = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical")   # 2 tiles + 1
    # the tiles' F0 + B0 = 3 s while the third rank waits, then F1 + B1 = 3 s while both tiles wait
    assert end(sp, False, cores=2, waiting_slowdown=1.5) == pytest.approx(3 * 1.5 + 3 * 1.5)
    assert end(sp, True, cores=2, waiting_slowdown=1.5) == pytest.approx(3 * 1.5 ** 2 + 3 * 1.5)
    # half their time waiting at meetings: only the other half is exposed to the waiting rank's wake-ups
    assert end(sp, True, 0.5, cores=2, waiting_slowdown=1.5) == pytest.approx(3 * 1.25 ** 2 + 3 * 1.5)
    assert end(sp, True, cores=None, waiting_slowdown=1.5) == pytest.approx(6.0)   # a device each
    # 4 tiles on 2 cores take turns: 6 s of tile work on 2 cores. Independent, 4 compute beside the 1 waiting
    # rank (1 + 0.5 * 1/3, the slowdown measured with 3 waiting); in lockstep the 2 tiles off the cores wait
    # at their next meeting too: 2 compute beside 3 waiting. Then F1 + B1 = 3 s beside 4 waiting tiles.
    crowded = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)
    assert end(crowded, False, cores=2, waiting_slowdown=1.5) == pytest.approx(6 * (1 + 0.5 / 3) + 3 * 1.5)
    assert end(crowded, True, cores=2, waiting_slowdown=1.5) == pytest.approx(6 * 1.5 + 3 * 1.5)
    # waiting half their time at meetings does not spare them: the core each leaves runs another tile
    assert end(crowded, True, 0.5, cores=2, waiting_slowdown=1.5) == pytest.approx(6 * 1.5 + 3 * 1.5)
    # 3 tiles on 2 cores: one core runs two of them between meetings while the third tile's core idles at
    # the meeting, so the 9 s of tile work take 2 turns of 3 s (4.5 s shared evenly when independent)
    odd = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=3, slice_method="horizontal")
    assert end(odd, False, cores=2) == pytest.approx(4.5 + 3)
    assert end(odd, True, cores=2) == pytest.approx(6 + 3)


def test_a_lockstep_member_crowds_the_cores_only_by_its_exposed_share():
    """2 tiles + 1 stage, 2 micro-batches: the tiles' second forward runs beside the last stage's
    first micro-batch, 3 ranks on 2 cores. Tiles computing all their time crowd the cores, and
    their meetings pay ``crowded``; tiles waiting half their time at meetings leave a core's worth
    free for the stage, and their meetings pay nothing more."""
    sp = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2)

    def end(exposed, crowded_per_work):
        base = unit_costs(sp, lockstep=True, exposed=exposed)

        def cost(action):
            c = base(action)
            return dataclasses.replace(c, crowded=crowded_per_work * c.work) if c.group is not None else c
        return max(t.end for t in simulate(build_schedule(sp), cost, lambda a: 0.0, cores=2))

    assert end(1.0, 0.5) > end(1.0, 0.0) + 0.1
    assert end(0.5, 0.5) == pytest.approx(end(0.5, 0.0))
    assert end(0.75, 0.5) > end(0.75, 0.0)       # 1.5 + 1 cores' worth on 2: crowded, less so
    assert end(0.75, 0.5) - end(0.75, 0.0) < end(1.0, 0.5) - end(1.0, 0.0)


def test_hand_offs_cost_each_side_its_own_work_before_and_after_the_wire():
    lp = ParallelConfig(split_size=2, spatial_size=0)
    base = unit_costs(lp)

    def with_handoff(action):
        return Cost(0.25) if action.kind.is_p2p else base(action)
    ends = simulate(build_schedule(lp), with_handoff, lambda a: 0.5)
    # F0, send (0.25), wire (0.5), receive (0.25), F1, B1, send, wire, receive, B0
    assert max(t.end for t in ends) == pytest.approx(1 + 0.25 + 0.5 + 0.25 + 1 + 2 + 0.25 + 0.5 + 0.25 + 2)
    assert ends[0].compute == pytest.approx(1 + 0.25 + 0.25 + 2) and ends[1].compute == pytest.approx(3.5)
    net = planner.network_of(JobCalibration(((4, 1e-4), (1 << 20, 1e-3)), 0.0, 1, "cpu", 5e-4))
    assert net.handoff == pytest.approx((5e-4 - 2 * net.message(4)) / 2)
    assert "hand-off" in net.describe()


def test_step_setup_delays_each_rank_and_counts_as_compute():
    lp = ParallelConfig(split_size=2, spatial_size=0)
    plain = simulate(build_schedule(lp), unit_costs(lp), lambda a: 0.0)
    late = simulate(build_schedule(lp), unit_costs(lp), lambda a: 0.0, start=lambda rank: 0.5 * (rank + 1))
    # rank 1 waits for rank 0's forward anyway (its own set-up fits in that wait): + 0.5 only
    assert max(t.end for t in late) == pytest.approx(max(t.end for t in plain) + 0.5)
    assert [t.compute - p.compute for t, p in zip(late, plain)] == pytest.approx([0.5, 1.0])
    assert late[1].spans[0] == (0.0, 1.0, "setup")


class BookkeepingDevice(RecordingDevice):
    """Layer times from sizes (``flops``) with fixed per-layer bookkeeping terms."""

    def time_layers(self, pending, repeats, threads):
        return [dataclasses.replace(flops(request), optimizer=1e-3, replay=2e-3, replay_chunk=0.5e-3, gradients=1e-3,
                                    setup=0.25e-3, terms_exchange=0.75e-3) for request, _ in pending]


def BookkeepingTimer():
    return LayerTimer(BookkeepingDevice())


def test_gradient_action_replays_every_chunk_and_exchanges_terms_between_holders(resnet):
    """The engine's all-reduce action flattens the gradients of every copy of the stage a rank
    holds and replays the BatchNorm terms of every chunk of the batch (exchanged first when
    several ranks hold the stage); the optimizer step updates every copy; each copy is set up."""
    from mpi4dl_nb.layout import stage_holders
    from mpi4dl_nb.planner import step_time

    one = LayerTime(0, 0, optimizer=1e-3, replay=2e-3, replay_chunk=0.5e-3, gradients=1e-3, terms_exchange=0.75e-3)
    assert one.reduction(1) == pytest.approx(3e-3) and one.reduction(4) == pytest.approx(4.5e-3)
    assert one.reduction(2, holders=2) == pytest.approx(3.5e-3 + 1.5e-3) and one.bookkeeping == 3e-3
    captured = {}

    def capture(schedule, cost, message, cores, start, *rest):
        captured.update(cost=cost, schedule=schedule, start=start)
        return simulate(schedule, cost, message, cores, start, *rest)

    node, net = planner.Node(cores=None, copy_bandwidth=1e12), planner.Network(1e-5, 1e9)
    for cfg, chunks, copies in ((ParallelConfig(split_size=3, spatial_size=0, parts=2), 2, 3),
                                (ParallelConfig(split_size=3, spatial_size=0, times=1), 2, 6)):
        real = step_time.simulate
        step_time.simulate = capture
        try:
            planner.predict_step_time(resnet, cfg, 64, 2, timer=BookkeepingTimer(), node=node, network=net)
        finally:
            step_time.simulate = real
        costs = captured["cost"]
        for rank in range(cfg.world_size):
            actions = captured["schedule"].actions(rank)
            layers = {a.stage: costs.model.bounds[a.stage + 1] - costs.model.bounds[a.stage]
                      for a in actions if a.kind is ActionKind.ALLREDUCE}
            for action in (a for a in actions if a.kind is ActionKind.ALLREDUCE):
                holders = len(stage_holders(cfg, action.stage))
                per_layer = one.reduction(chunks, holders)
                held = costs.held[rank].count(action.stage)
                assert costs(action).work == pytest.approx(held * layers[action.stage] * per_layer)
            optim = next(a for a in actions if a.kind is ActionKind.OPTIM)
            held_layers = sum(costs.model.bounds[s + 1] - costs.model.bounds[s] for s in costs.held[rank])
            assert costs(optim).work == pytest.approx(held_layers * 1e-3)
            assert captured["start"](rank) == pytest.approx(held_layers * 0.25e-3)
        assert sum(len(h) for h in costs.held.values()) == copies      # GEMS: every rank holds two copies


def test_holders_all_reduce_is_one_meeting_per_collective_crowded_like_a_halo(resnet):
    """Several holders of a stage (GEMS, tiles) sum gradients, gather BatchNorm term counts and
    sum the terms: three collectives, each a meeting (crowded when ranks outnumber the cores);
    a stage without BatchNorm has one; a stage held by one rank none."""
    from torch import nn

    from mpi4dl_nb.planner import step_time

    captured = {}

    def capture(schedule, cost, *rest):
        captured.update(cost=cost, schedule=schedule)
        return simulate(schedule, cost, *rest)

    def allreduce_costs(layers, cfg, network):
        real = step_time.simulate
        step_time.simulate = capture
        try:
            planner.predict_step_time(layers, cfg, 64, 2, timer=FlopTimer(), network=network,
                                      node=planner.Node(cores=2, copy_bandwidth=1e12))
        finally:
            step_time.simulate = real
        schedule, costs = captured["schedule"], captured["cost"]
        return {(a.rank, a.stage): costs(a) for r in range(cfg.world_size) for a in schedule.actions(r)
                if a.kind is ActionKind.ALLREDUCE}

    plain = planner.Network(1e-5, 1e9)
    meeting = planner.Network(1e-5, 1e9, meeting=1e-3, crowding=Crowding(sync=2e-3))
    gems = ParallelConfig(split_size=3, spatial_size=0, times=1)
    base, met = allreduce_costs(resnet, gems, plain), allreduce_costs(resnet, gems, meeting)
    assert base.keys() == met.keys() and sorted(c.members for c in met.values()) == [1, 2, 2, 2, 2]
    for key, cost in met.items():       # stages 0 and 2 on ranks 0 and 2; rank 1 holds both copies of stage 1
        held_apart = cost.members == 2
        assert cost.delay - base[key].delay == pytest.approx(3e-3 if held_apart else 0.0)   # ResNet has BatchNorm
        assert cost.crowded == pytest.approx(3 * 2e-3 if held_apart else 0.0) and base[key].crowded == 0.0
    lp = allreduce_costs(resnet, ParallelConfig(split_size=3, spatial_size=0, parts=2), meeting)
    assert all(c.members == 1 and c.crowded == 0.0 for c in lp.values())
    convs = [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()), nn.Sequential(nn.Conv2d(4, 4, 3, padding=1)),
             nn.Sequential(nn.Conv2d(4, 4, 3, padding=1)), nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                                                            nn.Linear(4, 2))]
    no_norm = allreduce_costs(convs, gems, meeting)
    assert all(c.crowded == pytest.approx(2e-3 if c.members == 2 else 0.0) for c in no_norm.values())  # gradients only


def test_start_training_skips_the_walk_only_when_every_module_trains():
    from mpi4dl_nb.pipeline.stage_instance import start_training

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.ReLU())
    model(torch.randn(2, 1, 5, 5)).sum().backward()
    model[1].eval()
    start_training(model, model)
    assert all(m.training for m in model.modules()) and all(p.grad is None for p in model.parameters())

    class FrozenNorm(torch.nn.Sequential):      # a train() override keeps the norm in eval: still honoured
        def train(self, mode=True):
            super().train(mode)
            self[1].eval()
            return self
    frozen = FrozenNorm(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    frozen.eval()
    start_training(frozen, frozen)
    assert frozen.training and not frozen[1].training


def test_split_backward_costs_weight_gradients_apart_and_without_wire(resnet):
    """I + W = B; W = WEIGHT_GRADIENT_SHARE of the parametered layers' backward, no tile group, no wire;
    a parameterless layer's backward all in I, as are the halo wire and meetings of a spatial stage. The first
    stage is not split (``splits_backward``): its I is its B, its W nothing; nor is any stage of a schedule
    without W."""
    from mpi4dl_nb.pipeline.actions import Action
    from mpi4dl_nb.planner.step_time import WEIGHT_GRADIENT_SHARE, step_model

    zb = ParallelConfig(split_size=3, spatial_size=2, num_spatial_parts=2, slice_method="vertical", parts=4,
                        schedule="zb1")
    options = dict(timer=FlopTimer(), node=planner.Node(cores=None, copy_bandwidth=1e12),
                   network=planner.Network(latency=1e-3, bandwidth=1e9))
    costs = step_model(resnet, zb, 64, 4, **options).costs

    def backward_parts(stage: int, tile: int | None) -> tuple[Cost, Cost, Cost]:
        whole, first, weights = (costs(Action(kind, rank=0, tick=0, stage=stage, micro_batch=0, tile=tile))
                                 for kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                                              ActionKind.BACKWARD_WEIGHT))
        return whole, first, weights

    for stage, tile in ((1, 0), (2, None)):
        whole, first, weights = backward_parts(stage, tile)
        assert first.work + weights.work == pytest.approx(whole.work)
        assert first.delay == whole.delay and first.members == whole.members == (2 if stage == 1 else 1)
        assert weights.delay == 0.0 and weights.group is None
        bounds = range(costs.model.bounds[stage], costs.model.bounds[stage + 1])
        parametered = [i for i in bounds if costs.model.profiles[i].param_count]
        assert parametered
        assert weights.work == pytest.approx(WEIGHT_GRADIENT_SHARE * sum(
            costs.layer_time(stage, i, tile)[0].backward for i in parametered))
        assert 0 < weights.work < whole.work
    whole, first, weights = backward_parts(0, 0)
    assert first.work == whole.work > 0 and weights.work == 0.0 and first.delay == whole.delay > 0
    gpipe = step_model(resnet, zb.with_(schedule="gpipe"), 64, 4, **options).costs
    assert gpipe.weight_gradient(1, 0) == gpipe.weight_gradient(2, None) == 0.0


def test_time_model_ranks_zb1_and_interleaved_ahead_of_1f1b(resnet):
    """The prediction suggest and tune rank by: the deferred W fill 1F1B's bubbles, interleaving shrinks them."""
    timer, node, net = FlopTimer(), planner.Node(cores=None, copy_bandwidth=1e12), planner.Network(1e-5, 1e10)

    def predicted(schedule: str, chunks: int = 1) -> planner.TimePlan:
        cfg = ParallelConfig(split_size=2 * chunks, spatial_size=0, parts=4, schedule=schedule, virtual_stages=chunks)
        return planner.predict_step_time(resnet, cfg, 64, 8, timer=timer, node=node, network=net)

    whole, split, chunked = predicted("1f1b"), predicted("zb1"), predicted("interleaved", 2)
    assert split.seconds < whole.seconds and split.idle_fraction < whole.idle_fraction
    assert chunked.seconds < whole.seconds
    v_shaped = predicted("zbv", 2)       # 2 chunks per rank, split backward: its replay's small bubble
    assert v_shaped.seconds < whole.seconds and v_shaped.idle_fraction < whole.idle_fraction
    assert sum(split.ranks[0].phases.get(kind, 0.0) for kind in ("I", "W")) > 0 and "B" not in split.ranks[0].phases
