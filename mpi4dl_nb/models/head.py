"""Classifier head that works at any feature-map size: optional BN/ReLU, global average pool, linear."""
from __future__ import annotations

import torch
from torch import nn


class ClassifierHead(nn.Module):
    """``[BN] -> [ReLU] -> global average pool -> flatten -> linear``; returns logits (no softmax)."""

    def __init__(self, in_channels: int, num_classes: int, *, norm: bool = False,
                 relu: bool = False) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.norm = nn.BatchNorm2d(in_channels) if norm else nn.Identity()
        self.relu = nn.ReLU() if relu else nn.Identity()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.relu(self.norm(x)))))
