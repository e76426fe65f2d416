"""The exactness helper's check that every rank holds the same gradients: equal bits told by a digest, other copies
averaged and weighed against the tolerance (one process, the other rank's copy given)."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.exactness import SAME_ON_EVERY_RANK, _same_on_every_rank, bits_digest, relative_error


class TwoRanks:
    """The collectives ``_same_on_every_rank`` uses, as rank 0 of two whose other rank holds ``theirs``."""

    def __init__(self, theirs: nn.Module) -> None:
        self.theirs = theirs
        self.sums = 0

    def all_gather_object(self, obj: bytes, group: object = None) -> list[bytes]:
        return [obj, bits_digest(_flat(self.theirs))]

    def all_reduce(self, flat: torch.Tensor, group: object = None) -> torch.Tensor:
        self.sums += 1
        return flat + _flat(self.theirs)

    world_size = 2


def _flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.double().reshape(-1) for p in net.parameters()] + [b.double().reshape(-1)
                                                                                   for b in net.buffers()])


def _net(shift: float) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    for p in net.parameters():
        p.grad = torch.randn_like(p) + shift
    return net


def _errors(mine: nn.Module, theirs: nn.Module) -> tuple[dict[str, float], int]:
    errors: dict[str, float] = {}
    ctx = TwoRanks(theirs)
    _same_on_every_rank(mine, ctx, None, lambda name, a, e: errors.__setitem__(name, relative_error(a, e)))
    return errors, ctx.sums


def test_equal_copies_are_told_by_their_digest_without_a_sum():
    errors, sums = _errors(_net(0.0), _net(0.0))
    assert errors == {SAME_ON_EVERY_RANK: 0.0} and sums == 0


def test_copies_that_differ_are_summed_and_weighed():
    errors, sums = _errors(_net(0.0), _net(1e-3))
    assert sums == 1 and errors[SAME_ON_EVERY_RANK] > 1e-5          # a real difference: far over any tolerance
    errors, sums = _errors(_net(0.0), _net(1e-15))
    assert sums == 1 and 0 < errors[SAME_ON_EVERY_RANK] < 1e-12    # rounding: within the tolerance, as before
