"""BatchNorm/InstanceNorm running statistics replayed per call equal the serial order (one process)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from mpi4dl_nb.pipeline.bn_replay import RunningStatsLedger, merge_terms


class Twice(nn.Module):
    """One norm applied twice per forward (shared, as in a reused block)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(torch.tanh(self.norm(x)) * 3 + 1)


NORMS = {
    "batchnorm momentum": lambda: nn.BatchNorm2d(4, momentum=0.1),
    "batchnorm cumulative": lambda: nn.BatchNorm2d(4, momentum=None),
    "instancenorm": lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True, momentum=0.2),
    "instancenorm momentum None": lambda: nn.InstanceNorm2d(4, track_running_stats=True, momentum=None),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_a_norm_used_twice_replays_like_serial(name, monkeypatch):
    torch.manual_seed(0)
    chunks = [torch.randn(3, 4, 5, 5, dtype=torch.float64) * (i + 1) + i for i in range(4)]
    serial = Twice(NORMS[name]()).double()
    for x in chunks:
        serial(x)
    holders = [Twice(NORMS[name]()).double() for _ in range(2)]
    ledgers = [RunningStatsLedger(h) for h in holders]
    for ledger in ledgers:
        ledger.begin_step()
    for holder, ledger, mine in zip(holders, ledgers, ([3, 0], [2, 1])):
        for c in mine:
            with ledger.chunk(c):
                out = holder(chunks[c].clone().requires_grad_(True))
            out.sum().backward()            # autograd's saved tensors were not disturbed
    merged = merge_terms([ledger.terms for ledger in ledgers])
    assert all(len(calls) == 2 for term in merged.values() for calls in term)   # two calls per chunk

    def no_sync(*args, **kwargs):
        raise AssertionError("replay must not read device values into Python (.item())")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    for ledger in ledgers:
        ledger.replay(merged)
    monkeypatch.undo()
    for holder in holders:
        torch.testing.assert_close(holder.norm.running_mean, serial.norm.running_mean, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(holder.norm.running_var, serial.norm.running_var, rtol=1e-13, atol=1e-15)
        assert torch.equal(holder.norm.num_batches_tracked, serial.norm.num_batches_tracked)


class _ThreadGroup:
    """Holders as threads of one process: object gathers and tensor sums meet at a barrier."""

    def __init__(self, size: int) -> None:
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size)

    def meet(self, rank: int, value):
        self.barrier.wait()
        self.slots[rank] = value
        self.barrier.wait()
        found = list(self.slots)
        self.barrier.wait()
        return found


class _HolderComm:
    def __init__(self, world: _ThreadGroup, rank: int) -> None:
        self.world, self.rank = world, rank

    def all_gather_object(self, obj, group=None):
        return self.world.meet(self.rank, obj)

    def all_reduce(self, tensor, group=None):
        tensor.copy_(sum(self.world.meet(self.rank, tensor.clone())))
        return tensor


def test_gathered_terms_are_the_first_holders_in_group_order_moved_as_one_tensor():
    from mpi4dl_nb.comm.handles import Group
    from mpi4dl_nb.pipeline.dataparallel import gather_terms

    norms = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.BatchNorm2d(2).double())
    ledger = RunningStatsLedger(norms)

    def call(width, value, dtype):
        return (torch.full((width,), value, dtype=dtype), torch.full((width,), -value / 3, dtype=dtype))

    f32, f64 = torch.float32, torch.float64
    held = [   # holder 0: chunks 0 and 2 (norm 1 called twice in chunk 2); holder 1: chunks 1 and 2
        {0: [[call(3, 0.1, f32)], [call(2, 0.2, f64)]], 2: [[call(3, 0.3, f32)], [call(2, 0.4, f64)] * 2]},
        {1: [[call(3, 1.1, f32)], [call(2, 1.2, f64)]], 2: [[call(3, 9.0, f32)], [call(2, 9.0, f64)] * 2]},
    ]
    world = _ThreadGroup(2)
    group = Group((0, 1))
    results = [None, None]

    def run(rank):
        results[rank] = gather_terms(_HolderComm(world, rank), held[rank], group, ledger)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = merge_terms(held)           # chunk 2 from holder 0, the first in group order
    for got in results:
        assert sorted(got) == [0, 1, 2]
        for chunk, term in want.items():
            assert [len(calls) for calls in got[chunk]] == [len(calls) for calls in term]
            for calls, got_calls in zip(term, got[chunk]):
                for (m, v), (gm, gv) in zip(calls, got_calls):
                    assert torch.equal(m, gm) and torch.equal(v, gv) and gm.dtype == m.dtype


def _one_norm_at_a_time(ledger: RunningStatsLedger, terms) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The replay written out norm by norm and call by call (each update as the norm's own kernel writes it)."""
    found = []
    for index, m in enumerate(ledger.norms):
        mean, var, tracked = (t.clone() for t in ledger.start[index])
        for chunk in sorted(terms):
            for t_mean, t_var in terms[chunk][index]:
                tracked += 1
                if m.momentum is None:
                    factor = 1.0 / tracked.to(mean.dtype)
                    mean, var = factor * t_mean + (1.0 - factor) * mean, factor * t_var + (1.0 - factor) * var
                else:
                    mean, var = t_mean + (1.0 - m.momentum) * mean, t_var + (1.0 - m.momentum) * var
        found.append((mean, var, tracked))
    return found


def test_norms_replayed_together_are_bitwise_the_norms_replayed_one_at_a_time():
    torch.manual_seed(1)
    model = nn.Sequential(nn.BatchNorm2d(3, momentum=0.1), Twice(nn.BatchNorm2d(3, momentum=0.1)),
                          nn.BatchNorm2d(3, momentum=0.3), nn.BatchNorm2d(3, momentum=None))
    ledger = RunningStatsLedger(model)
    for m in ledger.norms:            # a start that is not the initial one
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
        m.num_batches_tracked.fill_(5)
    ledger.begin_step()
    for chunk in (2, 0, 1):           # schedule order; the replay takes chunk order
        with ledger.chunk(chunk):
            model(torch.randn(4, 3, 6, 6) * (chunk + 1) + chunk)
    assert [len(calls) for calls in ledger.terms[0]] == [1, 2, 1, 1]
    want = _one_norm_at_a_time(ledger, ledger.terms)
    ledger.replay(ledger.terms)
    for m, (mean, var, tracked) in zip(ledger.norms, want):
        assert torch.equal(m.running_mean, mean) and torch.equal(m.running_var, var)
        assert torch.equal(m.num_batches_tracked, tracked)
    assert [int(m.num_batches_tracked) for m in ledger.norms] == [8, 11, 8, 8]


def test_a_recorded_call_leaves_the_norm_s_own_buffers_untouched_and_in_place():
    norm = nn.BatchNorm2d(3)
    ledger = RunningStatsLedger(norm)
    mean, var, tracked = norm.running_mean, norm.running_var, norm.num_batches_tracked
    before = (mean.clone(), var.clone(), tracked.clone())
    ledger.begin_step()
    with ledger.chunk(0):
        norm(torch.randn(2, 3, 4, 4))
        norm(torch.randn(2, 3, 4, 4))
    assert norm.running_mean is mean and norm.running_var is var and norm.num_batches_tracked is tracked
    assert all(torch.equal(a, b) for a, b in zip((mean, var, tracked), before))
    assert set(dict(norm.named_buffers())) == {"running_mean", "running_var", "num_batches_tracked"}
    assert len(ledger.terms[0][0]) == 2 and not torch.equal(ledger.terms[0][0][0][0], ledger.terms[0][0][1][0])
