"""Message tags: one table, ranges apart, and every tag the package sends inside its range."""

from __future__ import annotations

import itertools

import pytest

from mpi4dl_nb.comm import tags
from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.pipeline.schedules import build_schedule


def test_ranges_are_disjoint_and_within_the_mpi_minimum():
    for first, second in itertools.combinations(tags.RANGES, 2):
        assert first.stop <= second.start or second.stop <= first.start, (first, second)
    assert all(0 <= r.start and r.stop - 1 <= tags.MPI_MIN_TAG_UB for r in tags.RANGES)


def test_check_refuses_overlap_and_out_of_bounds():
    with pytest.raises(ValueError, match="overlap"):
        tags.check_ranges([tags.TagRange("a", 10, 5), tags.TagRange("b", 14, 2)])
    with pytest.raises(ValueError, match="inside"):
        tags.check_ranges([tags.TagRange("big", 32000, 1000)])
    tags.check_ranges([tags.TagRange("a", 10, 5), tags.TagRange("b", 15, 2)])   # touching is fine


def test_tag_offsets_stay_in_their_range():
    assert tags.HALO.tag(0) == 7100 and tags.HALO.tag(7) == 7107
    with pytest.raises(ValueError, match="halo"):
        tags.HALO.tag(8)
    assert 7107 in tags.HALO and 7108 not in tags.HALO


@pytest.mark.parametrize("cfg", [
    ParallelConfig(split_size=3, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                   parts=4, local_dp=2),
    ParallelConfig(split_size=2, spatial_size=0, parts=3, times=2),
])
def test_pipeline_messages_use_pipeline_tags(cfg):
    schedule = build_schedule(cfg)
    used = {a.tag for rank in range(schedule.world_size) for a in schedule.actions(rank)
            if a.kind.is_p2p}
    assert used and all(tag in tags.PIPELINE for tag in used)
    # activation and gradient messages of the two GEMS directions never share a tag
    classes = {(a.kind.carries_activation, a.replica): set() for r in range(schedule.world_size)
               for a in schedule.actions(r) if a.kind.is_p2p}
    for r in range(schedule.world_size):
        for a in schedule.actions(r):
            if a.kind.is_p2p:
                classes[(a.kind.carries_activation, a.replica)].add(a.tag)
    for one, other in itertools.combinations(classes.values(), 2):
        assert not one & other
