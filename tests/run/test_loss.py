"""run/loss.py: the class-weighted loss is a mean over samples, so micro-batches add up to the batch's loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mpi4dl_nb.run.loss import WeightedCrossEntropy, classification_loss


def test_weighted_loss_of_chunks_adds_up_where_torchs_weighted_mean_does_not():
    torch.manual_seed(0)
    logits = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 0, 0, 1, 2, 2, 1, 0])
    weights = (0.5, 2.0, 1.5)
    loss = WeightedCrossEntropy(weights)
    whole = loss(logits, labels)
    halves = sum(loss(logits[rows], labels[rows]) * 0.5 for rows in (slice(0, 4), slice(4, 8)))
    assert torch.allclose(whole, halves, rtol=0, atol=1e-15)
    expected = (F.cross_entropy(logits, labels, reduction="none") * torch.tensor(weights)[labels]).mean()
    assert torch.allclose(whole, expected)
    torch_mean = torch.nn.CrossEntropyLoss(weight=torch.tensor(weights, dtype=torch.float64))
    chunked = sum(torch_mean(logits[rows], labels[rows]) * 0.5 for rows in (slice(0, 4), slice(4, 8)))
    assert abs(float((chunked - torch_mean(logits, labels)).detach())) > 1e-3      # why the loss is not torch's
    (grad,) = torch.autograd.grad(whole, logits)
    assert grad.shape == logits.shape and torch.isfinite(grad).all()


def test_unit_weights_are_plain_cross_entropy_and_dense_outputs_work():
    torch.manual_seed(1)
    logits, labels = torch.randn(4, 2, 5, 5), torch.randint(0, 2, (4, 5, 5))
    assert torch.allclose(WeightedCrossEntropy((1.0, 1.0))(logits, labels), F.cross_entropy(logits, labels))
    assert isinstance(classification_loss(None), torch.nn.CrossEntropyLoss)
    assert isinstance(classification_loss((1.0, 3.0)), WeightedCrossEntropy)
