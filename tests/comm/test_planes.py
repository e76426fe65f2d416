"""Context delegates tensor traffic to its data plane (one process; multi-rank: test_comm.py)."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.comm.handles import Group, Request, Transfer


class RecordingPlane:
    """A DataPlane that records what the Context asks of it."""

    name = "recording"
    cuda_aware = False

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def exchange(self, transfers, via):
        self.calls.append(("exchange", via, [(t.send, t.peer, t.tag) for t in transfers]))
        receives = [t.tensor for t in transfers if not t.send]
        return Request(_Done(), on_done=lambda: [r.fill_(7) for r in receives])

    def all_reduce(self, tensor, group):
        self.calls.append(("all_reduce", group.ranks))

    def broadcast(self, tensor, root, group):
        self.calls.append(("broadcast", root, group.ranks))

    def process_group(self, ranks):
        return None

    def channel_group(self, src, dst):
        self.calls.append(("channel", src, dst))
        return None

    def close(self):
        self.calls.append(("close",))


class _Done:
    def wait(self):
        return None


@pytest.fixture(scope="module")
def ctx():
    from mpi4dl_nb.comm.context import Context

    return Context(backend="mpi", trace=False)


def test_mpi_context_runs_on_the_mpi_plane(ctx):
    from mpi4dl_nb.comm.mpi_plane import MpiPlane

    assert isinstance(ctx.data_plane, MpiPlane) and ctx.plane == "mpi" and not ctx.cuda_aware
    out, got = torch.arange(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    ctx.wait_all([ctx.irecv(got, 0, tag=5), ctx.isend(out, 0, tag=5)])   # to itself
    assert torch.equal(got, out)
    half = torch.arange(4, dtype=torch.bfloat16)
    back = torch.zeros(4, dtype=torch.bfloat16)
    ctx.wait_all([ctx.irecv(back, 0, tag=6), ctx.isend(half, 0, tag=6)])  # bfloat16 as int16 bits
    assert torch.equal(back, half)


def test_context_checks_then_delegates(ctx, monkeypatch):
    plane = RecordingPlane()
    monkeypatch.setattr(ctx, "data_plane", plane)
    t = torch.ones(3)
    assert ctx.all_reduce(t) is t and plane.calls == []              # a world of one: no traffic
    pair = Group((0, 1))
    ctx.all_reduce(t, group=pair)
    ctx.broadcast(t, root=1, group=pair)
    received = ctx.recv(torch.zeros(2), 0, tag=3)
    ctx.send(t, 0, tag=4)
    ctx.exchange([Transfer.to(t, 0, 5), Transfer.into(torch.zeros(1), 0, 5)], via=pair).wait()
    assert plane.calls == [("all_reduce", (0, 1)), ("broadcast", 1, (0, 1)),
                           ("exchange", None, [(False, 0, 3)]), ("exchange", None, [(True, 0, 4)]),
                           ("exchange", pair, [(True, 0, 5), (False, 0, 5)])]
    assert torch.equal(received, torch.full((2,), 7.0))             # on_done ran at wait()
    assert ctx.plane == "recording"
    with pytest.raises(ValueError, match="contiguous"):
        ctx.isend(torch.ones(4, 4).t(), 0)
    with pytest.raises(ValueError, match="contiguous"):
        ctx.exchange([Transfer.to(t, 0), Transfer.into(torch.ones(4, 4).t(), 0)])
    with pytest.raises(ValueError, match="contiguous"):
        ctx.all_reduce(torch.ones(4, 4).t(), group=pair)
    assert len(plane.calls) == 5


def test_groups_and_channels_are_cached(ctx, monkeypatch):
    plane = RecordingPlane()
    monkeypatch.setattr(ctx, "data_plane", plane)
    group = ctx.new_group([0])
    count = ctx.cached_groups
    assert ctx.new_group([0]) is group and ctx.new_group((0,)) is group
    assert ctx.cached_groups == count >= 1
    with pytest.raises(ValueError, match="two distinct ranks"):
        ctx.channels([(0, 0)])
    with pytest.raises(ValueError, match="distinct ranks"):
        ctx.new_group([0, 0])


def test_group_without_communicator_says_so():
    outside = Group((1, 2))
    assert 0 not in outside and outside.size == 2 and outside.rank_of(2) == 1
    with pytest.raises(ValueError, match="not in group"):
        outside.communicator()


def test_request_completes_once():
    done = []
    request = Request(_Done(), on_done=lambda: done.append(1))
    request.wait()
    request.wait()
    assert request.done and done == [1]


def test_gloo_context_runs_on_the_torch_plane():
    import torch.distributed as dist

    from mpi4dl_nb.comm.context import Context
    from mpi4dl_nb.comm.torch_plane import TorchPlane

    gloo = Context(backend="gloo", trace=False)
    try:
        assert isinstance(gloo.data_plane, TorchPlane) and gloo.plane == "torch"
        assert dist.is_initialized() and gloo.world.torch_group is dist.group.WORLD
        solo = gloo.new_group([0])
        assert solo.ranks == (0,) and solo.torch_group is not None and solo.mpi_comm is not None
        t = torch.ones(3)
        gloo.data_plane.all_reduce(t, gloo.world)     # the plane itself, on a world of one
        assert torch.equal(t, torch.ones(3))
    finally:
        gloo.close()
    assert not dist.is_initialized()
