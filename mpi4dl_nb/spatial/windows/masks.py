"""Swin's attention mask of a tile's windows from their region labels, built once per dtype and device."""

from __future__ import annotations

import torch

from .plan import MASK_VALUE


class RegionMask:
    """The ``(windows, area, area)`` mask of windows whose slots carry region ``labels`` ``(windows, area)``: 0
    between slots of one region, ``MASK_VALUE`` across regions (timm keeps it as its ``attn_mask`` buffer)."""

    def __init__(self, labels: torch.Tensor) -> None:
        self.labels = labels
        self._built: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def like(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mask in ``tensor``'s dtype on its device."""
        key = (tensor.dtype, tensor.device)
        if key not in self._built:
            labels = self.labels.to(tensor.device)
            apart = labels.unsqueeze(2) != labels.unsqueeze(1)
            self._built[key] = torch.zeros(apart.shape, dtype=tensor.dtype, device=tensor.device).masked_fill(
                apart, MASK_VALUE)
        return self._built[key]
