"""BatchNorm/InstanceNorm running statistics replayed per call equal the serial order (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.pipeline.bn_replay import RunningStatsLedger, merge_terms, terms_to_cpu


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
    merged = merge_terms([terms_to_cpu(ledger.terms) for ledger in ledgers])
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


def test_terms_to_cpu_keeps_values_and_dtypes():
    terms = {3: [[(torch.arange(4.0), torch.ones(4, dtype=torch.float32) / 3)], []],
             1: [[], [(torch.zeros(2, dtype=torch.float64), torch.full((2,), 1 / 7, dtype=torch.float64))]]}
    back = terms_to_cpu(terms)
    for chunk, term in terms.items():
        for calls, got in zip(term, back[chunk]):
            for (m, v), (gm, gv) in zip(calls, got):
                assert torch.equal(m, gm) and torch.equal(v, gv) and gv.dtype == v.dtype
