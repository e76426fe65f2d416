"""Ring attention's schedule (pure): every member computes with every block exactly once, receives what its
predecessor held, the gradient accumulators come home, and the bytes formula counts what travels."""

from __future__ import annotations

import pytest

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.spatial.tokens.ring_steps import RingSchedule, checked_counts, ring_traffic

SIZES = [1, 2, 3, 4, 7]


@pytest.mark.parametrize("size", SIZES)
def test_every_member_merges_every_block_once_its_own_first(size):
    for position in range(size):
        order = RingSchedule(size, position).merge_order
        assert sorted(order) == list(range(size)) and order[0] == position


@pytest.mark.parametrize("size", SIZES)
def test_what_arrives_is_what_the_previous_member_held(size):
    schedules = [RingSchedule(size, p) for p in range(size)]
    for schedule in schedules:
        prev = schedules[schedule.prev]
        assert schedules[prev.next] is schedule
        for step in schedule.steps:
            if step.arriving is None:
                assert step.step == size - 1
                continue
            assert step.arriving == prev.steps[step.step].owner == schedule.steps[step.step + 1].owner


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_gradient_accumulators_visit_every_member_and_come_home(size):
    """Follow block j's accumulator: it starts at the member after j (j keeps its own share), is added to by the
    member holding j at each step, passed to the next member, and the last hop delivers it to j."""
    for owner in range(size):
        holder, visited = RingSchedule(size, owner).next, [owner]
        for step in range(1, size):
            assert RingSchedule(size, holder).owner_at(step) == owner
            visited.append(holder)
            receiver = RingSchedule(size, holder).next
            assert RingSchedule(size, receiver).gradient_owner_arriving(step) == owner
            holder = receiver
        assert holder == owner and sorted(visited) == list(range(size))


def test_one_member_sends_nothing():
    schedule = RingSchedule(1, 0)
    assert [s.passes_on for s in schedule.steps] == [False]
    assert ring_traffic((9,), 0, key_bytes=8).total == 0


def test_traffic_counts_the_blocks_each_member_passes_on():
    counts = (5, 1, 4, 3)
    # member 2 holds blocks 2, 1, 0, 3 at steps 0..3: passes on 2, 1, 0 forward; carries the gradient accumulators
    # of 1, 0 and 3 (its own block's share stays with it)
    traffic = ring_traffic(counts, 2, key_bytes=10, gradient_key_bytes=20)
    assert traffic.forward == 2 * (4 + 1 + 5) * 10
    assert traffic.backward == traffic.forward + 2 * (1 + 5 + 3) * 20
    every = [ring_traffic(counts, p, key_bytes=1) for p in range(4)]
    assert sum(t.forward for t in every) == 2 * 3 * sum(counts)     # every block makes P-1 hops forward


@pytest.mark.parametrize("counts,size,shown", [((3, 4), 3, "2 counts for a ring of 3"),
                                                ((3, 0, 2), 3, "at least one key"),
                                                ((3, 1.5), 2, "at least one key")])
def test_counts_that_do_not_fit_the_ring_are_refused(counts, size, shown):
    with pytest.raises(ConfigError, match=shown):
        checked_counts(counts, size)


def test_a_position_outside_the_ring_is_refused():
    with pytest.raises(ConfigError, match="position 3 in a ring of 3"):
        RingSchedule(3, 3)
