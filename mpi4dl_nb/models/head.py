"""Classifier head for any feature-map size: optional BN/ReLU, an optional slide encoder, a global pool (``PoolKind``),
linear."""
from __future__ import annotations

import torch
from torch import nn

from .pools import PoolKind, global_pool
from .slide_encoder import SlideEncoder, SlideEncoderSpec


class ClassifierHead(nn.Module):
    """``[BN] -> [ReLU] -> [slide encoder] -> global pool -> flatten -> linear``; returns logits (no softmax).

    ``pool``: average (default), max, attention-MIL, or tissue-mean, whose input carries the tissue fraction
    of each position as its last channel (not normalised, passed to the pool beside the features).
    ``encoder``: a transformer over the cells (``models/slide_encoder.py``); the pool then pools its output cells and
    the linear layer reads the class token beside them (``2 * in_channels`` features).
    """

    def __init__(self, in_channels: int, num_classes: int, *, norm: bool = False,
                 relu: bool = False, pool: PoolKind = PoolKind.AVG, encoder: SlideEncoderSpec | None = None) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.pool_kind = PoolKind(pool)
        self.norm = nn.BatchNorm2d(in_channels) if norm else nn.Identity()
        self.relu = nn.ReLU() if relu else nn.Identity()
        self.pool = nn.AdaptiveAvgPool2d(1) if self.pool_kind is PoolKind.AVG else global_pool(pool, in_channels)
        self.flatten = nn.Flatten(1)
        self.encoder = SlideEncoder(in_channels, encoder) if encoder is not None else None
        self.fc = nn.Linear(in_channels * (1 if encoder is None else 2), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tissue = self.pool_kind.tissue
        features = self.relu(self.norm(x[:, :-1] if tissue else x))
        token = None
        if self.encoder is not None:
            token, features = self.encoder(features)
        pooled = self.pool(torch.cat([features, x[:, -1:]], 1)) if tissue else self.flatten(self.pool(features))
        return self.fc(pooled if token is None else torch.cat([token, pooled], 1))
