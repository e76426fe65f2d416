"""Sums through the node's shared memory (issue 67): 3 ranks under mpiexec (tests/mpi/node_sum_checks.py), and a
one-rank world here."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.comm import node_sum
from mpi4dl_nb.comm.context import Context
from tests.mpi.node_sum_checks import CHECKS
from tests.support.battery import shared_job

JOB = shared_job(3, "node_sum_checks", timeout=120)


def test_three_members_sum_in_rank_order(shared_launch):
    shared_launch(JOB).require(list(CHECKS))


def test_one_member_sums_to_itself_in_place():
    node = Context().node_sum()
    assert node is not None and node.size == 1
    parts = [torch.arange(6.0, dtype=torch.float64).reshape(2, 3).t(), torch.ones(4)[:0].double()]
    want = [p.clone() for p in parts]
    assert node.reserve(6 * 8)
    node.all_reduce(parts)
    assert all(torch.equal(a, b) for a, b in zip(parts, want))


def test_sums_refuse_what_mpi_would_not_add(tmp_path):
    node = Context().node_sum()
    assert node is not None and node.reserve(64)
    with pytest.raises(ValueError, match="bfloat16"):
        node.all_reduce([torch.ones(4, dtype=torch.bfloat16)])
    assert node_sum.shm_room(str(tmp_path / "absent")) is None
    assert node_sum.shm_room(str(tmp_path)) > 0
