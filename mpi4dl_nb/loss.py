"""The losses of training and evaluation, in one place: cross-entropy of a class per image (weighted per class),
per-pixel cross-entropy, soft Dice and their sum (on whole maps or on tiles), and ``tile_mean``.

Every loss is a mean over samples, so the engine's micro-batches add up to the whole batch's loss exactly, on any
layout (torch's weighted ``cross_entropy`` divides by the batch's weight sum instead: ``ClassCrossEntropy``).
``DenseLoss`` passes every quantity that spans the image as a sum through one ``total`` function: the identity on one
process, a differentiable all-reduce over the tile group on tiles, so no rank holds the whole prediction or mask; its
formulas: docs/segmentation.md (Training: losses, layouts). ``tile_mean``: the serial mean of a per-element quantity
from its tiles.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from .comm.messages import Payload, as_items
from .config import Choice, parse_choice
from .errors import ConfigError
from .spatial.convert import runtime_of
from .spatial.reduce import replicated_sum

GroupSum = Callable[[torch.Tensor], torch.Tensor]   # a sum over the tile group, the same tensor on every tile
SMOOTH = 1e-5


class LossKind(Choice):
    """The per-pixel loss of ``--loss``."""

    CE = "ce"
    DICE = "dice"
    CE_DICE = "ce+dice"

    @property
    def cross_entropy(self) -> bool:
        return self is not LossKind.DICE

    @property
    def dice(self) -> bool:
        return self is not LossKind.CE


def weights_text(weights: Sequence[float]) -> str:
    """``class weights 1,3``: how a loss names its class weights."""
    return "class weights " + ",".join(f"{w:g}" for w in weights)


class ClassCrossEntropy(nn.Module):
    """Cross-entropy of a class per image: the mean over samples of ``weight[label] * cross_entropy(logits,
    label)`` (``class_weights`` None: every weight 1, ``F.cross_entropy`` itself)."""

    weight: torch.Tensor | None

    def __init__(self, class_weights: Sequence[float] | None = None) -> None:
        super().__init__()
        self.class_weights = None if class_weights is None else tuple(float(w) for w in class_weights)
        weight = None if self.class_weights is None else torch.tensor(self.class_weights, dtype=torch.float64)
        self.register_buffer("weight", weight)

    def describe(self) -> str:
        """``cross-entropy`` or ``cross-entropy, class weights 1,3``: the loss a ``val_loss`` is."""
        return "cross-entropy" + ("" if self.class_weights is None else f", {weights_text(self.class_weights)}")

    def per_sample(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each sample's weighted loss (per pixel for dense outputs): the loss is their mean."""
        losses = F.cross_entropy(logits, labels, reduction="none")
        if self.weight is None:
            return losses
        return losses * self.weight.to(losses.device, losses.dtype)[labels]

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return F.cross_entropy(logits, labels)
        return self.per_sample(logits, labels).mean()


def classification_loss(weights: Sequence[float] | None) -> ClassCrossEntropy:
    """The loss a classifier trains with: cross-entropy, weighted per class when ``weights`` are given."""
    return ClassCrossEntropy(weights)


@runtime_checkable
class TileLoss(Protocol):
    """A loss the engine can compute on tiles: ``on_tiles`` with a group sum equals the call on the whole map."""

    def __call__(self, output: Payload, target: Payload) -> torch.Tensor: ...

    def on_tiles(self, output: Payload, target: Payload, total: GroupSum) -> torch.Tensor: ...


@dataclass(frozen=True)
class JoinedLoss:
    """A classifier's loss on a spatial last stage: its head joined the tiles (a global pool's all-reduce, as
    ``dl.spatialize`` gives it), so every tile holds the whole logits and takes the whole ``loss_fn`` on them.

    Backward on every tile is then exact (docs/exactness.md, "The joined head on the tiles"): the join passes the
    logits' whole gradient to every tile and each tile's pool keeps its own pixels' share of it, so the trunk's
    tile gradients add up to one process's; the head's parameters, used on the joined values, get the whole
    gradient on every tile and are counted once (tile 0's). Output that is still tiles (a feature map's or tokens'
    tile: 3-d or more) is refused: it has no whole logits to take a class loss on.
    """

    loss_fn: Callable[[Payload, Payload], torch.Tensor]

    def __call__(self, output: Payload, target: Payload) -> torch.Tensor:
        return self.loss_fn(output, target)

    def on_tiles(self, output: Payload, target: Payload, total: GroupSum) -> torch.Tensor:
        """``loss_fn`` on the joined logits this tile holds (``total`` is not needed: nothing is left to sum)."""
        tiled = [tuple(t.shape) for t in as_items(output) if t.is_floating_point() and t.dim() > 2]
        if tiled:
            raise ConfigError("spatial_size", f"every stage is spatial, so the loss runs on the last stage's tiles, "
                                              f"and the model's output there is still tiles {tiled[0]}, not joined "
                                              f"logits: {_name(self.loss_fn)} needs a classifier whose head pools "
                                              f"the tiles (a global pool), a per-pixel loss on tiles "
                                              f"(mpi4dl_nb.loss.DenseLoss) for a dense model, or a layer stage "
                                              f"after the spatial ones (spatial_size < split_size)")
        return self.loss_fn(output, target)


def _name(loss_fn: object) -> str:
    """A loss's name in a message: the wrapped loss of a wrapper that keeps it as ``loss_fn`` (a LossWatch)."""
    inner = getattr(loss_fn, "loss_fn", None)
    return _name(inner) if inner is not None and inner is not loss_fn else type(loss_fn).__name__


def joined_on_tiles(loss_fn: Callable[[Payload, Payload], torch.Tensor]) -> TileLoss:
    """``loss_fn`` as the engine takes it on a spatial last stage: itself when it runs on tiles (a ``TileLoss``),
    else a ``JoinedLoss`` (a classifier's loss on the joined logits every tile holds)."""
    return loss_fn if isinstance(loss_fn, TileLoss) else JoinedLoss(loss_fn)


def local_sum(x: torch.Tensor) -> torch.Tensor:
    """The group sum of one process: the tensor itself."""
    return x


def _single(value: Payload, what: str) -> torch.Tensor:
    items = as_items(value)
    if len(items) != 1:
        raise ValueError(f"a per-pixel loss takes one {what} tensor, got {len(items)}; the model's last layer "
                         f"must return the logits alone")
    return items[0]


@dataclass(frozen=True)
class PixelSums:
    """What a dense loss is made of, per sample: the class-weighted cross-entropy and weight ``(N, 1)``, the
    soft Dice overlap ``sum(p y)`` and size ``sum(p) + sum(y)`` per class ``(N, C)`` (width 0: not needed).
    Sums over pixels, so tiles' sums add up to the whole map's."""

    nll: torch.Tensor
    weight: torch.Tensor
    overlap: torch.Tensor
    size: torch.Tensor

    def flat(self) -> torch.Tensor:
        """Every sum in one vector (one all-reduce)."""
        return torch.cat([t.reshape(-1) for t in (self.nll, self.weight, self.overlap, self.size)])

    def unflat(self, flat: torch.Tensor) -> PixelSums:
        """Sums of these shapes read back from ``flat`` (e.g. after a sum over the tiles)."""
        parts = flat.split([t.numel() for t in (self.nll, self.weight, self.overlap, self.size)])
        return PixelSums(*(p.view(t.shape) for p, t in zip(parts, (self.nll, self.weight, self.overlap, self.size))))


@dataclass(frozen=True)
class DenseLoss:
    """``kind`` of per-pixel loss with optional ``class_weights`` (one per class) and ``ignore_index``.

    Called as ``loss(logits, mask)`` with logits ``(N, C, H, W)`` and an integer mask ``(N, H, W)``;
    ``loss.on_tiles(logits_tile, mask_tile, total)`` gives the same value from tiles.
    """

    kind: LossKind = LossKind.CE
    class_weights: tuple[float, ...] | None = None
    ignore_index: int | None = None
    smooth: float = SMOOTH

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", parse_choice(LossKind, self.kind, "--loss",
                                                      f"one of {', '.join(LossKind.values())}"))
        if self.class_weights is not None:
            object.__setattr__(self, "class_weights", tuple(float(w) for w in self.class_weights))

    def describe(self) -> str:
        """``ce+dice, class weights 1,3, ignore 255``."""
        parts = [str(self.kind)]
        if self.class_weights is not None:
            parts.append(weights_text(self.class_weights))
        if self.ignore_index is not None:
            parts.append(f"ignore {self.ignore_index}")
        return ", ".join(parts)

    def check_classes(self, num_classes: int) -> None:
        """ConfigError when the class weights do not give one weight per class."""
        if self.class_weights is not None and len(self.class_weights) != num_classes:
            raise ConfigError("--class-weights", f"gives {len(self.class_weights)} weights for {num_classes} "
                                                 f"classes; give one per class, in class order")

    def __call__(self, output: Payload, target: Payload) -> torch.Tensor:
        return self.on_tiles(output, target, local_sum)

    def on_tiles(self, output: Payload, target: Payload, total: GroupSum) -> torch.Tensor:
        """The loss from this rank's tiles of the logits and the mask; ``total`` sums over the tiles (one call)."""
        mine = self.sums(_single(output, "output"), _single(target, "target"))
        return self.value(mine.unflat(total(mine.flat())))

    def sums(self, logits: torch.Tensor, mask: torch.Tensor) -> PixelSums:
        """The per-sample sums of ``kind`` over the pixels of ``logits`` (N, C, h, w) and ``mask`` (N, h, w), or
        over the voxels of a volume's ``logits`` (N, C, d, h, w) and ``mask`` (N, d, h, w)."""
        if logits.dim() not in (4, 5) or mask.dim() != logits.dim() - 1 or logits.shape[0] != mask.shape[0] \
                or logits.shape[2:] != mask.shape[1:]:
            raise ValueError(f"logits {tuple(logits.shape)} and mask {tuple(mask.shape)} do not match: a "
                             f"segmentation model must output (N, classes, H, W) for masks (N, H, W), or "
                             f"(N, classes, D, H, W) for label volumes (N, D, H, W)")
        count, classes = logits.shape[:2]
        self.check_classes(classes)
        positions = tuple(range(1, mask.dim()))   # the mask's pixel (voxel) dims; the logits' are one further
        valid = mask != self.ignore_index if self.ignore_index is not None else torch.ones_like(mask, dtype=torch.bool)
        labels = torch.where(valid, mask, torch.zeros_like(mask))
        none = logits.new_zeros((count, 0))
        nll = weight = overlap = size = none
        if self.kind.cross_entropy:
            per_pixel = F.cross_entropy(logits, labels, reduction="none")
            pixel_weight = valid.to(logits.dtype)
            if self.class_weights is not None:
                pixel_weight = self._weights(logits)[labels] * pixel_weight
            nll, weight = (per_pixel * pixel_weight).sum(positions)[:, None], pixel_weight.sum(positions)[:, None]
        if self.kind.dice:
            keep = valid.unsqueeze(1).to(logits.dtype)
            prob = torch.softmax(logits, dim=1) * keep
            truth = F.one_hot(labels, classes).movedim(-1, 1).to(logits.dtype) * keep
            pixels = tuple(p + 1 for p in positions)
            overlap, size = (prob * truth).sum(pixels), (prob + truth).sum(pixels)
        return PixelSums(nll, weight, overlap, size)

    def value(self, sums: PixelSums) -> torch.Tensor:
        """The loss from the sums over every pixel: cross-entropy over all samples, Dice per sample, averaged."""
        loss = sums.nll.new_zeros(())
        if self.kind.cross_entropy:
            counted = sums.weight > 0
            per_image = torch.where(counted, sums.nll / torch.where(counted, sums.weight, 1.0), 0.0)
            loss = loss + per_image.mean()
        if self.kind.dice:
            score = (2 * sums.overlap + self.smooth) / (sums.size + self.smooth)
            per_class = self._weights(score) if self.class_weights is not None else torch.ones_like(score[0])
            loss = loss + 1 - ((score * per_class).sum(1) / per_class.sum()).mean()
        return loss

    def _weights(self, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.class_weights, dtype=like.dtype, device=like.device)


def tile_mean(values: torch.Tensor, net: nn.Module, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``values`` over every tile of ``net``'s tile group: the serial mean of the full tensor.

    ``values`` is this rank's tile of a per-element quantity (e.g.
    ``F.cross_entropy(out_tile, target_tile, reduction="none")``); ``weights`` (same shape)
    gives a weighted mean ``sum(w * v) / sum(w)`` (ignore masks, class weights). The result
    is the same on every tile; back-propagate it on every tile (each tile's inputs then get
    exactly their share, as with a loss computed from ``gather_tiles``), then sum the tile
    gradients (``reduce_tile_gradients``).
    """
    runtime = runtime_of(net)
    if weights is None:
        numerator = values.sum()
        denominator = values.new_tensor(float(values.numel()))
    else:
        numerator = (values * weights).sum()
        denominator = weights.detach().sum().to(values.dtype)
    total = replicated_sum(torch.stack([numerator, denominator]), runtime.ctx, runtime.group)
    return total[0] / total[1]
