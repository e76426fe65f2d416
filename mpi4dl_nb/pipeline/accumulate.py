"""Gradient accumulation: each micro-step's (already summed over holders) gradients added up, applied as their mean."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class GradientSum:
    """The sum of several micro-steps' gradients of ``params``, kept apart from ``p.grad`` (which each micro-step's
    start drops and its all-reduce fills again)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)
        self.count = 0

    def add(self) -> bool:
        """Add the micro-step's gradients (then dropped from the parameters); False when it left none at all
        (a step skipped by the non-finite guard drops every gradient)."""
        grads = [p.grad for p in self.params]
        if self.params and all(g is None for g in grads):
            return False
        for i, grad in enumerate(grads):
            if grad is not None:
                previous = self.sums[i]
                self.sums[i] = grad if previous is None else previous.add_(grad)
        for p in self.params:
            p.grad = None
        self.count += 1
        return True

    def apply(self) -> None:
        """Put the mean of the added gradients into the parameters (None where no micro-step had one)."""
        for p, total in zip(self.params, self.sums):
            p.grad = None if total is None else total.div_(max(self.count, 1))
        self.sums = [None] * len(self.params)
        self.count = 0

    def drop(self) -> None:
        """Forget everything added, and the parameters' gradients."""
        for p in self.params:
            p.grad = None
        self.sums = [None] * len(self.params)
        self.count = 0
