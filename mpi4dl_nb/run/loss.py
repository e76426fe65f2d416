"""The training loss of ``train``: cross-entropy, weighted per class (``--class-weights``), averaged over the samples.

torch's weighted ``cross_entropy`` divides by the sum of the batch's weights, so a micro-batch's loss
scaled by its share of the batch would not add up to the batch's: here every sample's loss is multiplied by
its class weight and the mean is over samples (per-pixel losses: over samples and pixels), so the engine's
chunks add up to the batch's loss exactly on any layout.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class WeightedCrossEntropy(nn.Module):
    """Mean over samples of ``weight[label] * cross_entropy(logits, label)``."""

    weight: torch.Tensor

    def __init__(self, weights: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("weight", torch.tensor(list(weights), dtype=torch.float64))

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(logits, labels, reduction="none")
        return (losses * self.weight.to(losses.device, losses.dtype)[labels]).mean()


def classification_loss(weights: Sequence[float] | None) -> nn.Module:
    """Plain cross-entropy (``weights`` None), or the class-weighted one."""
    return nn.CrossEntropyLoss() if weights is None else WeightedCrossEntropy(weights)
