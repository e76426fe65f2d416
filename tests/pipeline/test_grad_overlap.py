"""Gradient all-reduce overlapped with backward (issue 44): buckets, their hooks and their order (unit), and
under mpiexec the same result as the all-reduce after all backwards, posted during backward (both planes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.comm.handles import Group
from mpi4dl_nb.comm.trace import Tracer
from mpi4dl_nb.config import ParallelConfig
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.pipeline.actions import ActionKind
from mpi4dl_nb.pipeline.grad_buckets import MB, GradientReducer, weight_gradient_passes
from mpi4dl_nb.pipeline.schedules import build_schedule
from mpi4dl_nb.planner.fake_world import FakeComm
from tests.support.battery import shared_job

CASES = ["dp2_buckets", "localdp2_buckets", "sync_dp2_buckets", "gems_buckets"]
MPI_JOB = shared_job(2, "grad_overlap", *CASES, timeout=300)
GLOO_JOB = shared_job(2, "grad_overlap", "--backend=gloo", "dp2_buckets", "gems_buckets", plane="gloo", timeout=300)
SPATIAL_JOB = shared_job(3, "grad_overlap", "sp_se_buckets", timeout=300)


def checks(cases: list[str]) -> list[str]:
    return [f"{case} {what}" for case in cases for what in ("same as after backward", "posted during backward")]


def test_overlap_equals_reduction_after_backward_and_posts_during_backward(shared_launch):
    """float64 within 1e-12 of grad_bucket_mb=None; first bucket posted before the first layer's gradient."""
    shared_launch(MPI_JOB).require(checks(CASES))


def test_overlap_on_torch_distributed_plane(shared_launch):
    shared_launch(GLOO_JOB).require(checks(["dp2_buckets", "gems_buckets"]))


def test_overlap_on_spatial_stage_with_tile_replicated_parameters(shared_launch):
    """SE gates' parameters hold the full gradient on every tile: only tile 0 contributes them."""
    shared_launch(SPATIAL_JOB).require(checks(["sp_se_buckets"]))


# ----------------------------------------------------------------------------- unit
class Posts:
    """A FakeComm that records each non-blocking all-reduce (its size) and traces."""

    def __init__(self) -> None:
        self.comm = FakeComm(0, None, torch.device("cpu"), world_size=2)
        self.comm._tracer = Tracer(0)
        self.posted: list[int] = []
        original = self.comm.iall_reduce

        def record(tensor: torch.Tensor, group: Group | None = None):
            self.posted.append(tensor.numel())
            tensor.mul_(2)   # as if the other holder had the same gradient
            return original(tensor, group)
        self.comm.iall_reduce = record   # type: ignore[method-assign]
        self.comm.bcast_object = lambda obj, root=0, group=None: obj   # type: ignore[method-assign]


def tiny_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def backward(net: nn.Module, seed: int) -> None:
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    net(x).square().sum().backward()


def reducer_for(nets: list[nn.Module], cap_bytes: float) -> tuple[GradientReducer, Posts]:
    posts = Posts()
    reducer = GradientReducer(posts.comm, cap_bytes)
    reducer.add_stage(0, nets, Group((0, 1)))
    return reducer, posts


def test_buckets_follow_reverse_order_and_cap():
    net = tiny_net()
    reducer, _ = reducer_for([net], cap_bytes=8 * 40)   # 40 float64 per bucket at most (one slot at least)
    sizes = [[s.numel for s in b.slots] for b in reducer.stages[0].buckets]
    assert sizes == [[3, 24, 8], [64], [8, 32]]   # last layer's bias first; 64 float64 would pass the cap
    reducer, _ = reducer_for([net], cap_bytes=MB)
    assert len(reducer.stages[0].buckets) == 1


def test_bucket_is_posted_by_the_last_pass_and_sums_every_copy():
    """Two passes per step: nothing posted during the first; each bucket posted in order during the second,
    the first before the first layer's gradient arrived; finish writes (copy 0 + copy 1) * holders."""
    nets = [tiny_net(), tiny_net()]   # a GEMS pair on one rank: separate parameters
    first_layer_seen_at: list[int] = []   # buckets posted when layer 0's weight gradient arrived (this hook first)
    nets[0][0].weight.register_post_accumulate_grad_hook(lambda _p: first_layer_seen_at.append(stage.posted))
    reducer, posts = reducer_for(nets, cap_bytes=8 * 40)
    stage = reducer.stages[0]
    reducer.begin_step({0: [2, 1]})
    backward(nets[0], 1)
    assert posts.posted == [] and stage.posted == 0
    backward(nets[1], 2)      # copy 1's only pass: buckets complete now (copy 0's already did its two)
    assert posts.posted == [] and stage.posted == 0   # copy 0 still has one pass to go
    expected = {name: None for name, _ in nets[0].named_parameters()}
    backward(nets[0], 3)
    assert stage.posted == len(stage.buckets) == 3
    assert first_layer_seen_at == [0, 2]   # 2 of 3 buckets posted before layer 0's last weight gradient
    for name, p0 in nets[0].named_parameters():
        expected[name] = 2 * (p0.grad + dict(nets[1].named_parameters())[name].grad)
    moved = reducer.finish(0)
    assert moved == sum(p.numel() for p in nets[0].parameters()) * 8
    for net in nets:
        for name, p in net.named_parameters():
            assert torch.equal(p.grad, expected[name]), name
    events = [e for e in posts.comm.tracer.events if e.op == "allreduce-post"]
    assert [e.extra["bucket"] for e in events] == list(range(3))
    assert all(e.extra["during_backward"] == 1 for e in events)


class WithSpare(nn.Module):
    """The tiny net and a layer registered last that forward never uses (no gradient arrives)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = tiny_net()
        self.spare = nn.Linear(2, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_unused_parameters_wait_for_finish_and_are_deferred_after_the_first_step():
    net = WithSpare()
    unused = net.spare
    reducer, posts = reducer_for([net], cap_bytes=8 * 40)
    stage = reducer.stages[0]
    reducer.begin_step({0: [1]})
    backward(net, 1)
    assert stage.posted == 0   # the first bucket holds the unused parameter: it blocks the order
    reducer.finish(0)
    assert torch.equal(unused.weight.grad, torch.zeros(2, 2, dtype=torch.float64))
    assert stage.buckets[-1].deferred and {id(s.params[0]) for s in stage.buckets[-1].slots} == \
        {id(unused.weight), id(unused.bias)}
    net.zero_grad(set_to_none=True)
    reducer.begin_step({0: [1]})
    backward(net, 2)
    assert stage.posted == len(stage.buckets) - 1   # every bucket but the deferred one during backward
    reducer.finish(0)
    assert stage.posted == len(stage.buckets)


def test_a_gradient_after_its_bucket_was_posted_is_refused():
    net = tiny_net()
    reducer, _ = reducer_for([net], cap_bytes=MB)
    reducer.begin_step({0: [1]})
    backward(net, 1)
    with pytest.raises(RuntimeError, match="after the bucket's all-reduce was posted"):
        backward(net, 2)


def test_without_counted_passes_every_bucket_waits_for_finish():
    """A schedule whose weight-gradient actions are not counted: nothing posted early, same sums."""
    net = tiny_net()
    reducer, posts = reducer_for([net], cap_bytes=8 * 40)
    reducer.begin_step({0: [0]})
    backward(net, 1)
    assert posts.posted == []
    grads = {name: 2 * p.grad for name, p in net.named_parameters()}
    reducer.finish(0)
    assert all(torch.equal(p.grad, grads[name]) for name, p in net.named_parameters())


def test_hooks_are_quiet_outside_a_step_and_removable():
    net = tiny_net()
    reducer, posts = reducer_for([net], cap_bytes=MB)
    backward(net, 1)            # before any step (e.g. profiling a stage): not counted
    assert posts.posted == []
    reducer.remove()
    reducer.begin_step({0: [1]})
    backward(net, 2)
    assert posts.posted == []


def test_weight_gradient_passes_count_backward_actions():
    schedule = build_schedule(ParallelConfig(split_size=2, spatial_size=0, parts=4, times=1, schedule="1f1b"))
    actions = schedule.actions(0)
    backwards = [a for a in actions if a.kind is ActionKind.BACKWARD]
    counted = sum(weight_gradient_passes(actions, r, s) for r in (0, 1) for s in (0, 1))
    assert counted == len(backwards) and counted > 0
    assert weight_gradient_passes(actions, 0, 0, merged_copies=2) == weight_gradient_passes(actions, 0, 0) // 2


@pytest.mark.parametrize("value", [0, -1.0, "25", True])
def test_bucket_size_knob_is_checked(value):
    with pytest.raises(ConfigError, match="grad_bucket_mb"):
        ParallelConfig(grad_bucket_mb=value)


def test_bucket_size_knob_defaults_to_ddp_size_and_can_be_off():
    assert ParallelConfig().grad_bucket_mb == 25.0          # on by default: the planner models the buckets
    assert ParallelConfig(grad_bucket_mb=0.5).grad_bucket_mb == 0.5
    assert ParallelConfig(grad_bucket_mb=None).as_dict()["grad_bucket_mb"] is None


def test_a_lone_copy_keeps_its_gradient_without_a_flat_copy_and_two_copies_are_summed():
    """The old path (dataparallel.sum_stage_gradients) on a stage one rank holds alone allocates nothing (it made a
    parameter-sized flat copy at the step's end: one process held one parameter set more than plain torch);
    two copies on one rank (a GEMS mirror) still get their sum."""
    from mpi4dl_nb.measure.steps import measure_peak_bytes
    from mpi4dl_nb.pipeline.dataparallel import sum_stage_gradients

    comm = FakeComm(0, None, torch.device("cpu"), world_size=1)
    torch.manual_seed(0)
    lone = nn.Linear(256, 256, dtype=torch.float64)
    for p in lone.parameters():
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in lone.parameters()]
    moved, peak = measure_peak_bytes(lambda: sum_stage_gradients(comm, [lone], None))
    assert peak == 0 and moved == sum(p.numel() * 8 for p in lone.parameters())
    assert all(torch.equal(p.grad, b) for p, b in zip(lone.parameters(), before))
    mirror = nn.Linear(256, 256, dtype=torch.float64)
    for p in mirror.parameters():
        p.grad = torch.randn_like(p)
    want = [a.grad + b.grad for a, b in zip(lone.parameters(), mirror.parameters())]
    sum_stage_gradients(comm, [lone, mirror], None)
    for a, b, w in zip(lone.parameters(), mirror.parameters(), want):
        assert torch.equal(a.grad, w) and torch.equal(b.grad, w)
