"""The loss of a classifier whose every stage is spatial (one process): ``JoinedLoss`` takes the wrapped loss on the
joined logits every tile holds, value and gradient, and refuses an output that is still tiles, naming the way out;
``joined_on_tiles`` keeps a loss that runs on tiles and wraps any other (the run's ``LossWatch`` included)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.loss import ClassCrossEntropy, DenseLoss, JoinedLoss, joined_on_tiles
from mpi4dl_nb.run.divergence import LossWatch


def _never_summed(t: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the joined logits need no sum over the tiles")


def test_the_joined_loss_is_the_class_loss_on_the_logits_every_tile_holds():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 2, 1, 2])
    loss = ClassCrossEntropy((1.0, 2.0, 0.5))
    want = loss(logits, labels)
    (want_grad,) = torch.autograd.grad(want, logits)
    got = JoinedLoss(loss).on_tiles(logits, labels, _never_summed)
    (got_grad,) = torch.autograd.grad(got, logits)
    assert got.item() == want.item() and torch.equal(got_grad, want_grad)


@pytest.mark.parametrize("shape", [(2, 3, 8, 4), (2, 5, 3)])   # a feature map's tile, a token tile
def test_output_still_in_tiles_is_refused_naming_the_way_out(shape):
    watched = LossWatch(nn.CrossEntropyLoss())
    with pytest.raises(ConfigError, match="spatial_size") as refused:
        JoinedLoss(watched).on_tiles(torch.zeros(shape), torch.zeros(shape[0], dtype=torch.long), _never_summed)
    message = str(refused.value)
    assert "CrossEntropyLoss" in message and "DenseLoss" in message and "split_size" in message
    assert not watched.losses, "a refused loss was recorded"


def test_a_loss_on_tiles_is_kept_and_any_other_is_joined():
    dense = DenseLoss()
    assert joined_on_tiles(dense) is dense
    watched = LossWatch(ClassCrossEntropy())
    joined = joined_on_tiles(watched)
    assert isinstance(joined, JoinedLoss) and joined.loss_fn is watched
    logits, labels = torch.randn(2, 3), torch.tensor([1, 0])
    assert joined.on_tiles(logits, labels, _never_summed).item() == watched.losses[-1].item()
