"""Allocations: a dispatch mode recording the element count of every tensor an op returns (forward and backward),
to check that attention never makes a tensor as large as its full score matrix."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Allocations(TorchDispatchMode):
    """The element counts of every tensor an op returns while active (the first use imports torch._dynamo)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self.numels.append(value.numel())
        return result

    @property
    def largest(self) -> int:
        return max(self.numels, default=0)
