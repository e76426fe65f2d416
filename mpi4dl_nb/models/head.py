"""Classifier head for any feature-map size: optional BN/ReLU, a global pool (``PoolKind``), linear."""
from __future__ import annotations

import torch
from torch import nn

from .pools import PoolKind, global_pool


class ClassifierHead(nn.Module):
    """``[BN] -> [ReLU] -> global pool -> flatten -> linear``; returns logits (no softmax).

    ``pool``: average (default), max, attention-MIL, or tissue-mean, whose input carries the tissue fraction
    of each position as its last channel (not normalised, passed to the pool beside the features).
    """

    def __init__(self, in_channels: int, num_classes: int, *, norm: bool = False,
                 relu: bool = False, pool: PoolKind = PoolKind.AVG) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.pool_kind = PoolKind(pool)
        self.norm = nn.BatchNorm2d(in_channels) if norm else nn.Identity()
        self.relu = nn.ReLU() if relu else nn.Identity()
        self.pool = nn.AdaptiveAvgPool2d(1) if self.pool_kind is PoolKind.AVG else global_pool(pool, in_channels)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool_kind.tissue:
            features = self.relu(self.norm(x[:, :-1]))
            return self.fc(self.pool(torch.cat([features, x[:, -1:]], 1)))
        return self.fc(self.flatten(self.pool(self.relu(self.norm(x)))))
