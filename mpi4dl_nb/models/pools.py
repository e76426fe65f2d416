"""The global pools a classifier head ends its trunk with (``--pool``): average, max, tissue-mean, attention-MIL."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Choice
from ..spatial.mil_pool import softmax_pool


class PoolKind(Choice):
    """How the head pools the trunk's feature map to one vector per image (``--pool``)."""

    AVG = "avg"                    # mean over every position
    MAX = "max"                    # per channel over every position; the first maximum (row-major) takes the gradient
    TISSUE_MEAN = "tissue-mean"    # mean over the positions a tissue mask marks (the input's last channel)
    ATTENTION = "attention"        # gated attention-MIL (Ilse et al. 2018) over every position

    @property
    def multiple_instance(self) -> bool:
        """Whether it pools a whole canvas as a bag of positions (the slide-level pools, not plain averaging)."""
        return self is not PoolKind.AVG

    @property
    def tissue(self) -> bool:
        """Whether the model's input carries a tissue channel last (``models/tissue.py``)."""
        return self is PoolKind.TISSUE_MEAN


class GlobalMaxPool(nn.Module):
    """(N, C, H, W) -> (N, C): the maximum over every position; ties go to the first in row-major order, on tiles
    too (the op guard computes ``adaptive_max_pool2d(x, 1)`` over the whole image)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_max_pool2d(x, 1).flatten(1)


class AttentionMILPool(nn.Module):
    """Gated attention-MIL pooling: ``a = softmax_i(w^T (tanh(V h_i) * sigmoid(U h_i)))``, ``z = sum_i a_i h_i`` over
    every position ``i`` (V, U, w as 1x1 convolutions: per position, exact on tiles); (N, C, H, W) -> (N, C)."""

    def __init__(self, channels: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or max(1, channels // 2)
        self.V = nn.Conv2d(channels, hidden, 1)
        self.U = nn.Conv2d(channels, hidden, 1)
        self.w = nn.Conv2d(hidden, 1, 1, bias=False)   # a bias would shift every score alike: no effect

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """The attention logits of every position, (N, 1, H, W) (before the softmax)."""
        return self.w(torch.tanh(self.V(h)) * torch.sigmoid(self.U(h)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return softmax_pool(h, self.scores(h))


class TissueMeanPool(nn.Module):
    """(N, C + 1, H, W) -> (N, C): the features' mean over the positions weighted by the last channel (the tissue
    fraction of each position, ``models/tissue.py``); a canvas without tissue pools to zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features, tissue = x[:, :-1], x[:, -1:]
        weight = tissue.sum((2, 3))
        return (features * tissue).sum((2, 3)) / weight.clamp_min(torch.finfo(weight.dtype).tiny)


def global_pool(kind: PoolKind, channels: int) -> nn.Module:
    """The pooling layer of ``kind`` for ``channels`` features (tissue-mean takes one channel more: the mask)."""
    if kind is PoolKind.MAX:
        return GlobalMaxPool()
    if kind is PoolKind.ATTENTION:
        return AttentionMILPool(channels)
    if kind is PoolKind.TISSUE_MEAN:
        return TissueMeanPool()
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
