"""DenseLoss: per-pixel cross-entropy and soft Dice, their sum; on tiles (sums over a group) equal to the whole map."""

import pytest
import torch
import torch.nn.functional as F

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.spatial.dense_loss import DenseLoss, LossKind, TileLoss

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
