"""No host sync per action: a training step reads no tensor value into Python but its loss, for every schedule.

The MPI program (tests/mpi/step_host_reads.py) runs each schedule on the torch plane (gloo: NCCL's code path)
under ``HostReads``; the tests here also check that ``HostReads`` sees every kind of read, where it was made,
and that its rules let through only what they name, as often as they allow.
"""

from __future__ import annotations

import torch
from torch import nn

from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.spatial.norm import batch_norm_factor
from tests.mpi.step_host_reads import CASES, SPATIAL, check_name
from tests.support.battery import shared_job
from tests.support.host_reads import Allowed, HostReads
from tests.support.planes import backend_flag

JOB = shared_job(3, "step_host_reads", backend_flag("gloo"), plane="gloo", timeout=300)


def test_a_training_step_reads_no_tensor_value_per_action(shared_launch):
    assert set(CASES) == {"gpipe", "1f1b", "interleaved", "zb1", "zbv", "gems"}   # every ScheduleKind, and GEMS
    shared_launch(JOB).require_clean([check_name(case) for case in CASES])


def test_every_kind_of_read_is_seen_and_the_attributes_are_back_after():
    t = torch.arange(1.0, 4.0, dtype=torch.float64)
    before = dict(vars(torch.Tensor)), dict(vars(torch))
    reads = [lambda: t.sum().item(), lambda: float(t[0]), lambda: int(t[0]), lambda: bool(t[0]),
             lambda: t.tolist(), lambda: t.numpy(), lambda: t.cpu(), lambda: [0, 1][t[0].long()],
             lambda: torch.equal(t, t), lambda: t[t > 1], lambda: t.nonzero(), lambda: torch.unique(t)]
    for read in reads:
        with HostReads() as seen:
            read()
        assert sum(seen.reads.values()) >= 1, read
    with HostReads() as seen:
        y = t * 2 + t[1:].sum()          # values stay tensors: nothing read
        t[t.new_ones(3, dtype=torch.long) - 1] = y[:3]
    assert not seen.reads
    assert dict(vars(torch.Tensor)) == before[0] and dict(vars(torch)) == before[1]


def test_a_read_in_a_backward_is_seen_under_its_package_frame():
    """A read in torch's own code (a BatchNorm with momentum None reads its counter) is filed under the package
    function that led to it; so is one made in a backward, which torch runs with function modes off."""
    norm = nn.BatchNorm2d(2, momentum=None)

    class Reading(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * grad.sum().item()

    x = torch.randn(2, 2, 3, 3, requires_grad=True)
    with HostReads() as seen:
        factor = batch_norm_factor(norm)
        Reading.apply(x).sum().backward()
    assert factor == 1.0
    sites = {(read.op, read.module, read.function) for read in seen.reads}
    assert ("Tensor.__float__", "spatial/norm.py", "batch_norm_factor") in sites
    assert ("Tensor.item", "", "") in sites      # made outside the package


def test_rules_allow_their_site_only_as_often_as_they_say():
    norm = nn.BatchNorm2d(2, momentum=None)
    rule = Allowed("spatial/norm.py", "batch_norm_factor", "a test", most=1)
    with HostReads() as seen:
        batch_norm_factor(norm)
    assert seen.unexpected([rule]) == []
    assert len(seen.unexpected([])) == 1
    with HostReads() as seen:
        batch_norm_factor(norm)
        batch_norm_factor(norm)
    (found,) = seen.unexpected([rule])
    assert found.startswith("2 reads at spatial/norm.py batch_norm_factor, at most 1")


def test_every_case_fits_the_three_rank_launch():
    assert {case: ParallelConfig(**SPATIAL, **config).world_size for case, config in CASES.items()} == \
        dict.fromkeys(CASES, 3)
