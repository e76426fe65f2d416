"""loss.py: DenseLoss (per-pixel cross-entropy and soft Dice, their sum; on tiles equal to the whole map) and
the class-weighted cross-entropy of classifiers (a mean over samples: micro-batches add up to the batch's loss)."""

import pytest
import torch
import torch.nn.functional as F

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.loss import ClassCrossEntropy, DenseLoss, LossKind, TileLoss, classification_loss

IGNORE = 255


def data(batch: int = 4, classes: int = 3, size: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, classes, size, size, dtype=torch.float64, generator=gen)
    y = torch.randint(0, classes, (batch, size, size), generator=gen)
    y[0, 0, :5] = IGNORE
    y[1] = IGNORE                      # an image with every pixel ignored
    return x, y


def quarters(t: torch.Tensor) -> list[torch.Tensor]:
    h, w = t.shape[-2] // 2, t.shape[-1] // 2
    return [t[..., :h, :w], t[..., :h, w:], t[..., h:, :w], t[..., h:, w:]]


@pytest.mark.parametrize("kind", LossKind.values())
def test_tiles_give_the_whole_maps_loss_and_gradient(kind):
    x, y = data()
    loss = DenseLoss(kind, (1.0, 2.0, 0.5), IGNORE)
    whole = x.clone().requires_grad_(True)
    loss(whole, y).backward()
    tiles = [t.clone().requires_grad_(True) for t in quarters(x)]
    got = []
    sums = [loss.sums(t.detach(), yt).flat() for t, yt in zip(quarters(x), quarters(y))]
    total = torch.stack(sums).sum(0)
    for tile, yt in zip(tiles, quarters(y)):
        value = loss.on_tiles(tile, yt, lambda v: v + (total - v.detach()))   # the group sum, gradient passed on
        value.backward()
        got.append(value.item())
    assert max(abs(v - loss(x, y).item()) for v in got) < 1e-12
    grads = torch.cat([t.grad.reshape(-1) for t in tiles])
    want = torch.cat([g.reshape(-1) for g in quarters(whole.grad)])
    assert torch.allclose(grads, want, atol=1e-14, rtol=0)


@pytest.mark.parametrize("kind", LossKind.values())
def test_a_mean_over_images_so_micro_batches_add_up(kind):
    x, y = data()
    loss = DenseLoss(kind, (1.0, 2.0, 0.5), IGNORE)
    halves = (loss(x[:2], y[:2]) + loss(x[2:], y[2:])) / 2
    assert abs(halves.item() - loss(x, y).item()) < 1e-12


def test_cross_entropy_without_weights_is_torchs_mean_over_pixels():
    x, y = data()
    y[y == IGNORE] = 0
    assert abs(DenseLoss("ce")(x, y).item() - F.cross_entropy(x, y).item()) < 1e-12


def test_ignored_pixels_get_no_gradient_and_an_all_ignored_image_counts_zero():
    x, y = data()
    x.requires_grad_(True)
    DenseLoss("ce+dice", None, IGNORE)(x, y).backward()
    ignored = (y == IGNORE).unsqueeze(1).expand_as(x)
    assert x.grad[ignored].abs().max() == 0 and x.grad[~ignored].abs().max() > 0
    sums = DenseLoss("ce", None, IGNORE).sums(x.detach(), y)
    assert sums.weight[1].item() == 0


def test_soft_dice_scores_a_perfect_prediction_near_zero():
    y = torch.randint(0, 3, (2, 8, 8))
    logits = F.one_hot(y, 3).permute(0, 3, 1, 2).double() * 50
    assert DenseLoss("dice")(logits, y).item() < 1e-6
    assert DenseLoss("dice")(-logits, y).item() > 0.9


def test_refusals():
    x, y = data()
    with pytest.raises(ConfigError, match="2 weights for 3 classes"):
        DenseLoss("ce", (1.0, 2.0))(x, y)
    with pytest.raises(ValueError, match="do not match"):
        DenseLoss("ce")(x, y[:, :4])
    with pytest.raises(ValueError, match="logits alone"):
        DenseLoss("ce")((x, x), y)
    with pytest.raises(ConfigError, match="--loss"):
        DenseLoss("focal")
    assert isinstance(DenseLoss(), TileLoss) and not isinstance(torch.nn.CrossEntropyLoss(), TileLoss)
    assert DenseLoss("ce+dice", (1, 2), 255).describe() == "ce+dice, class weights 1,2, ignore 255"


def test_weighted_loss_of_chunks_adds_up_where_torchs_weighted_mean_does_not():
    torch.manual_seed(0)
    logits = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 0, 0, 1, 2, 2, 1, 0])
    weights = (0.5, 2.0, 1.5)
    loss = ClassCrossEntropy(weights)
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
    assert torch.allclose(ClassCrossEntropy((1.0, 1.0))(logits, labels), F.cross_entropy(logits, labels))
    assert torch.equal(classification_loss(None)(logits, labels), F.cross_entropy(logits, labels))   # bitwise
    weighted = classification_loss((1.0, 3.0))
    assert torch.equal(weighted.per_sample(logits, labels).mean(), weighted(logits, labels))
    assert (classification_loss(None).describe(), weighted.describe()) == ("cross-entropy",
                                                                         "cross-entropy, class weights 1,3")
