"""Schedules as data: tables, step-through order, message matching and deadlock freedom."""

from __future__ import annotations

import doctest
import itertools
from collections import defaultdict, deque

import pytest

from mpi4dl_nb.config import ConfigError, ParallelConfig
from mpi4dl_nb.pipeline import schedules
from mpi4dl_nb.pipeline.actions import P2P_KINDS, Action
from mpi4dl_nb.pipeline.schedules import (
    Schedule,
    build_schedule,
    chunk_index,
    gems,
    gpipe,
    ideal_bubble_fraction,
    one_f_one_b,
)


def compute_order(schedule: Schedule, rank: int) -> list[str]:
    return [a.label() for a in schedule.actions(rank) if a.kind in ("F", "B")]


def test_module_docstring_table_is_real():
    failures, attempted = doctest.testmod(schedules, verbose=False)
    assert attempted >= 1 and failures == 0


def test_three_tables_print(capsys):
    for schedule in (gpipe(3, 4), one_f_one_b(3, 4), gems(3, 4)):
        text = schedule.table()
        print(text)
        lines = text.splitlines()
        assert lines[0].split("|")[0].strip() == "tick"
        assert len(lines) == 3 + schedule.num_ticks
        assert all(f"rank {r}" in lines[0] for r in range(3))
    out = capsys.readouterr().out
    assert "F3'" in out and "B0'" in out      # the GEMS mirror appears
    assert "AR" in out and "OPT" in out


def test_gpipe_order_and_length():
    s = gpipe(3, 4)
    for rank in range(3):
        assert compute_order(s, rank) == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]
    # equal stages: 2 * (m + S - 1) compute ticks, plus the all-reduce tick
    assert s.num_ticks == 2 * (4 + 3 - 1) + 1
    busy = sum(len(compute_order(s, r)) for r in range(3))
    assert 1 - busy / (3 * (s.num_ticks - 1)) == pytest.approx(ideal_bubble_fraction(3, 4))


def test_one_f_one_b_order():
    s = one_f_one_b(3, 4)
    assert compute_order(s, 0) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert compute_order(s, 1) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert compute_order(s, 2) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    # at most S - s micro-batches in flight on stage s (the point of 1F1B)
    for rank in range(3):
        live = peak = 0
        for label in compute_order(s, rank):
            live += 1 if label[0] == "F" else -1
            peak = max(peak, live)
        assert peak == 3 - rank


def test_gems_mirror_runs_reverse_stages_on_same_ranks():
    s = gems(3, 4, times=1)
    for rank in range(3):
        stages = {(a.replica, a.stage) for a in s.actions(rank) if a.kind == "F"}
        assert stages == {(0, rank), (1, 2 - rank)}
    # both directions start at tick 0 on the two end ranks
    first = {a.rank: a for a in s.global_order() if a.kind == "F" and a.tick == 0}
    assert first[0].replica == 0 and first[2].replica == 1
    # the gradient all-reduce of stage s spans its primary and mirror holders
    ar = [a for a in s.actions(0) if a.kind == "ALLREDUCE"]
    assert [a.stage for a in ar] == [0, 2] and ar[0].group == (0, 2)


def test_gems_times_runs_pairs_one_after_another():
    s = gems(2, 1, times=2)
    order = compute_order(s, 0)
    assert order.index("B0") < order.index("F1") and order.index("B0'") < order.index("F1'")


def test_stepper_walks_one_action_at_a_time_in_dependency_order():
    s = gpipe(3, 4)
    stepper = s.stepper()
    seen: list[Action] = []
    done_f: set[tuple[int, int]] = set()
    sent: set[tuple[int, int, int]] = set()
    while not stepper.done:
        nxt = stepper.peek()
        action = stepper.step()
        assert action is nxt
        if action.kind == "F":
            assert action.stage == 0 or (action.stage - 1, action.micro_batch) in done_f
            done_f.add((action.stage, action.micro_batch))
        if action.kind.startswith("SEND"):
            sent.add((action.rank, action.peer, action.tag))
        if action.kind.startswith("RECV"):
            assert (action.peer, action.rank, action.tag) in sent, action.describe()
        seen.append(action)
    assert stepper.step() is None
    assert seen == stepper.history == s.global_order()
    assert [a.kind for a in seen[-2:]] == ["ALLREDUCE", "OPTIM"]
    assert seen[0].describe().startswith("rank 0 tick 0: forward stage 0")
    # the runtime's own view: one rank's actions, same order as its schedule list
    assert list(s.stepper(ranks=[1])) == s.actions(1)


CONFIGS = [
    dict(split_size=2, spatial_size=0, parts=3),
    dict(split_size=4, spatial_size=0, parts=5, schedule="1f1b"),
    dict(split_size=3, spatial_size=0, parts=2, times=2),
    dict(split_size=3, spatial_size=0, parts=3, times=1, schedule="1f1b"),
    dict(split_size=2, spatial_size=1, num_spatial_parts=4, parts=2, times=1),
    dict(split_size=3, spatial_size=2, num_spatial_parts=2, slice_method="vertical", parts=2,
         schedule="1f1b"),
    dict(split_size=3, spatial_size=1, num_spatial_parts=2, slice_method="vertical", local_dp=2,
         parts=3, schedule="1f1b"),
    dict(split_size=2, spatial_size=0, local_dp=2, data_parallel=2, parts=2, times=1),
    dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="horizontal",
         local_dp=2, times=1, parts=2, data_parallel=2),
    # sync_batchnorm: the copies of a micro-batch run together (collectives in F and B)
    dict(split_size=2, spatial_size=0, data_parallel=2, parts=3, schedule="1f1b", sync_batchnorm=True),
    dict(split_size=3, spatial_size=1, num_spatial_parts=2, slice_method="vertical", local_dp=2,
         parts=3, schedule="1f1b", sync_batchnorm=True),
    dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="horizontal",
         local_dp=2, times=1, parts=2, data_parallel=2, sync_batchnorm=True),
    dict(split_size=3, spatial_size=2, num_spatial_parts=2, slice_method="vertical", local_dp=2,
         parts=2, data_parallel=2, sync_batchnorm=True),
    # interleaved (issue 44): chunks of several stages on one rank, a spatial first stage, replicas
    dict(split_size=4, spatial_size=0, parts=4, schedule="interleaved", virtual_stages=2),
    dict(split_size=6, spatial_size=0, parts=4, schedule="interleaved", virtual_stages=3),
    dict(split_size=8, spatial_size=0, parts=8, schedule="interleaved", virtual_stages=2),
    dict(split_size=4, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2,
         schedule="interleaved", virtual_stages=2, data_parallel=2),
]


def simulate_mpi(schedule: Schedule) -> None:
    """Execute all ranks' lists with buffered sends and blocking receives; fail on deadlock.

    Compute actions of a spatial stage also wait for every tile rank to reach them (their
    halo exchanges are collective within the tile group); with sync_batchnorm every copy's
    and replica's compute of one micro-batch waits for all of them (BatchNorm all-reduces).
    """
    queues = {r: deque(schedule.actions(r)) for r in range(schedule.world_size)}
    mailbox: dict[tuple[int, int, int], int] = defaultdict(int)
    at_barrier: dict[tuple, set[int]] = defaultdict(set)
    cfg = schedule.cfg
    tile_ranks = schedules.stage_ranks(cfg)
    while any(queues.values()):
        progressed = False
        for rank, queue in queues.items():
            while queue:
                a = queue[0]
                if a.kind.startswith("SEND"):
                    mailbox[(a.rank, a.peer, a.tag)] += 1
                elif a.kind.startswith("RECV"):
                    key = (a.peer, a.rank, a.tag)
                    if mailbox[key] == 0:
                        break
                    mailbox[key] -= 1
                elif a.kind in ("F", "B") and cfg.sync_batchnorm:
                    spatial = a.stage < cfg.spatial_size
                    key = (a.kind, a.replica, a.stage, a.micro_batch, a.copy if spatial else -1)
                    members = {m for d in range(cfg.data_parallel)
                               for m in tile_ranks[(d, a.replica, a.stage)]}
                    at_barrier[key].add(rank)
                    if len(at_barrier[key]) < len(members):
                        break
                elif a.kind in ("F", "B") and a.tile is not None:
                    key = (a.kind, a.dp, a.replica, a.stage, a.micro_batch, a.copy)
                    at_barrier[key].add(rank)
                    if len(at_barrier[key]) < len(tile_ranks[(a.dp, a.replica, a.stage)]):
                        break
                queue.popleft()
                progressed = True
        if not progressed:
            heads = {r: q[0].describe() for r, q in queues.items() if q}
            raise AssertionError(f"deadlock: {heads}")
    assert not any(mailbox.values()), "unreceived messages"


@pytest.mark.parametrize("kwargs", CONFIGS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_every_schedule_matches_messages_and_cannot_deadlock(kwargs):
    cfg = ParallelConfig(**kwargs)
    s = build_schedule(cfg)
    assert s.world_size == cfg.world_size
    simulate_mpi(s)
    sends = sorted((a.rank, a.peer, a.tag) for r in range(s.world_size) for a in s.actions(r)
                   if a.kind.startswith("SEND"))
    recvs = sorted((a.peer, a.rank, a.tag) for r in range(s.world_size) for a in s.actions(r)
                   if a.kind.startswith("RECV"))
    assert sends == recvs
    # every stage runs every chunk exactly once forward and once backward (per tile)
    n_chunks = cfg.batch_divisor
    for kind in ("F", "B"):
        for stage in range(cfg.split_size):
            chunks = [a.chunk for r in range(s.world_size) for a in s.actions(r)
                      if a.kind == kind and a.stage == stage and a.tile in (None, 0)]
            assert sorted(chunks) == list(range(n_chunks)), (kind, stage)
    # tags of messages in flight at once between a pair never collide
    for r in range(s.world_size):
        tags = [(a.peer, a.tag, a.kind) for a in s.actions(r) if a.kind in P2P_KINDS]
        assert len(tags) == len(set(tags))


def test_chunk_index_nesting():
    cfg = ParallelConfig(split_size=2, spatial_size=0, parts=2, times=1, local_dp=2,
                         data_parallel=2)
    seen = set()
    for d, r, u, k in itertools.product(range(2), range(2), range(2), range(2)):
        seen.add(chunk_index(cfg, d, r, u, k))
    assert seen == set(range(16))
    # replica 1 (mirror) takes the odd GEMS chunk: its micro-batch 0 copy 0 follows replica 0's
    assert chunk_index(cfg, 0, 1, 0, 0) == 4 and chunk_index(cfg, 1, 0, 0, 0) == 8


def test_bad_schedule_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="schedule"):
        build_schedule(ParallelConfig(split_size=2, spatial_size=0), kind="zigzag")


def test_table_with_comm_shows_peers():
    text = gpipe(2, 1).table(show_comm=True)
    assert ">1 act 0" in text and "<0 act 0" in text and ">0 grad 0" in text
