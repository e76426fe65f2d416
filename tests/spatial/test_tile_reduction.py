"""Tile gradients summed during backward (issue 67): equal to the single all-reduce bit for bit in float64 on 2 ranks
(tests/mpi/tile_reduction_checks.py); the torch plane keeps the single all-reduce."""

from __future__ import annotations

from mpi4dl_nb.comm.context import Context
from tests.mpi.tile_reduction_checks import check_names
from tests.support.battery import shared_job

JOB = shared_job(2, "tile_reduction_checks", plane="mpi", timeout=200)


def test_overlapped_tile_reduction_equals_one_all_reduce(shared_launch):
    shared_launch(JOB).require(check_names())


def test_only_the_mpi_plane_makes_a_private_group():
    ctx = Context()
    group = ctx.private_group()
    assert group is not None and group.ranks == ctx.world.ranks and group.mpi_comm is not ctx.world.mpi_comm
