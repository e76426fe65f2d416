"""The job calibration the time model takes from the ranks: ping-pong points, the costs of a
meeting of two ranks and of all ranks, the ranks' torch threads, the slowdown of computing beside
waiting ranks; every rank gets the same."""

from __future__ import annotations

import math

import torch

import mpi4dl_nb as dl
from mpi4dl_nb.comm.waiting import node_cores
from mpi4dl_nb.measure.calibration import calibrate_job, meeting_cost
from mpi4dl_nb.planner.crowding import Crowding
from mpi4dl_nb.planner.timing import network_of
from tests.support.checks import Checks, run_checks

CHECKS = ["calibration agreed by every rank", "calibration values", "network from calibration",
          "meetings of several groups at once"]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    calibration = calibrate_job(ctx)
    with check("calibration agreed by every rank"):
        everyone = ctx.all_gather_object(calibration)
        assert all(c == everyone[0] for c in everyone), everyone
    with check("calibration values"):
        sizes = [size for size, _ in calibration.points]
        assert sizes == sorted(sizes) and len(sizes) == 4, calibration.points
        assert all(0 < seconds < 1 for _, seconds in calibration.points), calibration.points
        crowded = calibration.crowded      # the crowded-core rounds: only while 3 ranks outnumber the CPU cores
        assert (crowded is not None) == (ctx.device.type == "cpu" and ctx.world_size > node_cores()), calibration
        assert calibration.device == str(ctx.device), calibration
        for value in (calibration.pair_seconds, *((crowded.crowd_seconds, crowded.crowd_short_seconds)
                                                  if crowded else ())):
            assert math.isfinite(value) and 0 <= value < 0.1, calibration
        assert calibration.threads == torch.get_num_threads() == 1 and calibration.ranks == ctx.world_size == 3
        if crowded is not None:
            assert math.isfinite(crowded.waiting_slowdown) and 1.0 <= crowded.waiting_slowdown < 10, calibration
        # each relay's extra over the work alone is clamped at 0: on a loaded machine the median can be 0
        assert 0 <= calibration.handoff_seconds < 0.1, calibration
    with check("network from calibration"):
        network = network_of(calibration)
        assert network.latency > 0 and network.bandwidth > 0
        assert network.meeting == calibration.pair_seconds
        crowding = network.crowding
        if crowded is None:
            assert crowding == Crowding(), crowding
        else:
            assert crowding.sync == max(0.0, crowded.crowd_seconds - calibration.pair_seconds)
            assert crowding.sync_short == max(0.0, crowded.crowd_short_seconds - calibration.pair_seconds)
            assert crowding.waiting_slowdown == crowded.waiting_slowdown and crowding.crowd_members == 3
        assert 0 <= network.handoff <= calibration.handoff_seconds
        assert network.handoff < calibration.handoff_seconds or calibration.handoff_seconds == 0

    with check("meetings of several groups at once"):     # each group meets among its own members
        apart = meeting_cost(ctx, rounds=10, work_seconds=0.2e-3, repeats=1, groups=[(0, 1), (2,)])
        assert math.isfinite(apart) and 0 <= apart < 0.1 and ctx.all_gather_object(apart) == [apart] * 3
        alone = meeting_cost(ctx, rounds=10, work_seconds=0.2e-3, repeats=1, groups=[(0,), (1,), (2,)])
        assert alone == 0.0          # nobody to meet: no timing, and no rank waits for another
        for bad in ([(0, 1), (1, 2)], [(0, 3)]):     # a rank in two groups, a rank not in the job
            try:
                meeting_cost(ctx, groups=bad)
            except ValueError as err:      # every rank refuses alike, before any meets: nobody waits
                assert "disjoint groups of ranks 0..2" in str(err), err
            else:
                raise AssertionError(f"groups={bad} accepted")


if __name__ == "__main__":
    run_checks(main)
