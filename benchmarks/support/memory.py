"""Activation bytes of a forward: unique storages autograd saves for backward, plus the output."""

from __future__ import annotations

import torch
from torch import nn


class SavedBytes:
    """Unique storage bytes of the tensors autograd saves inside ``saved_tensors_hooks(self.pack, ...)``."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def add(self, tensor: torch.Tensor) -> None:
        self.pack(tensor)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def activation_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes saved for backward by ``module(x)`` plus its output (each storage once)."""
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = module(x)
    counter.add(out)
    return counter.total
