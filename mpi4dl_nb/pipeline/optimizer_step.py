"""A training step's optimizer step: fp16 gradients unscaled (the step skipped on every rank when one is not finite),
clipped to a global norm, ZeRO's shards taking their gradients before and the whole weights rebuilt after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch

from ..comm.protocol import Comm
from ..sharding.seam import Sharding
from .grad_clip import clip_by_global_norm
from .precision import LossScaler

WholeGradients = Callable[[int], list[torch.Tensor]]   # stage -> the gradients this rank counts of a stage held whole


class OptimizerStep:
    """``optimizer``'s step on this rank (None: no step), with ``scaler`` (fp16) and ``max_grad_norm`` (None: no
    clipping); ``held``: the stages this rank holds; ``whole(stage)``: the gradients it counts in the global norm of
    a stage held whole (its lowest holder: all of them; another holder: none)."""

    def __init__(self, ctx: Comm, optimizer: torch.optim.Optimizer | None, sharding: Sharding,
                 scaler: LossScaler | None, max_grad_norm: float | None, held: list[int],
                 whole: WholeGradients) -> None:
        self.ctx, self.optimizer, self.sharding, self.scaler = ctx, optimizer, sharding, scaler
        self.max_grad_norm, self.held, self.whole = max_grad_norm, held, whole

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No step while inside (gradient accumulation's micro-steps)."""
        optimizer, self.optimizer = self.optimizer, None
        try:
            yield
        finally:
            self.optimizer = optimizer

    def run(self) -> None:
        """The optimizer's step when its gradients are usable, clipped first to ``max_grad_norm``."""
        if self.optimizer is None:
            return
        self.sharding.before_step()
        if self.gradients_usable():
            if self.max_grad_norm is not None:
                self.clip(self.max_grad_norm)
            self.optimizer.step()
        self.sharding.after_step()

    def gradients_usable(self) -> bool:
        """fp16: unscale the gradients; False (step skipped on every rank) when any is not finite."""
        if self.scaler is None or self.optimizer is None:
            return True
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.scaler.unscale(self.ctx, params, self.ctx.device)

    def clip(self, max_norm: float) -> float:
        """Scale the stepped gradients to global norm ``max_norm`` at most; every element counted once: a shard on
        its holder, a stage held whole on its lowest holder (one copy). Collective over the world; the norm."""
        assert self.optimizer is not None
        counted = [grad for stage in self.held
                   for grad in self.sharding.counted_gradients(stage, partial(self.whole, stage))]
        scaled = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_by_global_norm(self.ctx, counted, scaled, max_norm)
