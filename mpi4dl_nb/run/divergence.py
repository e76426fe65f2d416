"""Divergence guard: a non-finite loss or gradient stops the run (or skips the step) before the optimizer applies it."""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING

import torch

from ..loss import GroupSum, TileLoss
from ..pipeline.actions import Action, ActionKind

if TYPE_CHECKING:
    from ..comm.messages import Payload
    from ..comm.protocol import Comm
    from ..pipeline.engine import HybridEngine

EXIT_NONFINITE = 3
MAX_SKIPS_IN_A_ROW = 5


class OnNonFinite(str, Enum):
    """What a non-finite loss or gradient does: stop the run, or skip that step."""

    STOP = "stop"
    SKIP_STEP = "skip-step"


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss/gradient/weight; every rank raises it at the same point."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


class LossWatch:
    """Wraps a loss function and remembers this step's first non-finite chunk loss on this rank."""

    def __init__(self, loss_fn: Callable[[Payload, Payload], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.losses: list[torch.Tensor] = []     # the step's chunk losses, kept on the device (no read per chunk)

    def __call__(self, output: Payload, target: Payload) -> torch.Tensor:
        return self.seen(self.loss_fn(output, target))

    def seen(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, kept for the step's check without reading it."""
        self.losses.append(loss.detach())
        return loss

    @property
    def bad(self) -> float | None:
        """The step's first non-finite chunk loss (None: all finite); one read, a second only when one is bad."""
        index = nonfinite_index(self.losses)
        return None if index is None else float(self.losses[index])

    def reset(self) -> None:
        self.losses = []


class TileLossWatch(LossWatch):
    """A LossWatch of a loss the engine also computes on tiles (a ``TileLoss``: every stage spatial)."""

    def __init__(self, loss_fn: TileLoss) -> None:
        super().__init__(loss_fn)
        self.tile_loss = loss_fn

    def on_tiles(self, output: Payload, target: Payload, total: GroupSum) -> torch.Tensor:
        return self.seen(self.tile_loss.on_tiles(output, target, total))


def watch(loss_fn: Callable[[Payload, Payload], torch.Tensor]) -> LossWatch:
    """The LossWatch of ``loss_fn`` (one that runs on tiles too when ``loss_fn`` does)."""
    return TileLossWatch(loss_fn) if isinstance(loss_fn, TileLoss) else LossWatch(loss_fn)


def _floating(named: Iterable[tuple[str, object]]) -> list[tuple[str, torch.Tensor]]:
    """The non-empty floating tensors among ``named`` (nested dicts flattened, their names joined by dots)."""
    found: list[tuple[str, torch.Tensor]] = []
    for name, value in named:
        if isinstance(value, Mapping):
            found += _floating((f"{name}.{k}", v) for k, v in value.items())
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            found.append((name, value))
    return found


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s elements, half types summed in float32 (finite unless an element is not, or it
    overflows)."""
    return tensor.detach().sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)


def nonfinite_index(tensors: Sequence[torch.Tensor]) -> int | None:
    """Index of the first floating tensor with a NaN/inf, else None: per device, one read of every tensor's sum
    (a NaN or inf makes its sum NaN or inf; a pass ~6x quicker on CPU than the largest magnitude), then, only where
    a sum is not finite (a bad element, or an overflow), one fused reduction of the largest magnitudes (NaN kept)
    to find the first bad tensor. One value read per device, not a read per tensor."""
    found = [i for i, tensor in enumerate(tensors) if tensor.is_floating_point() and tensor.numel()]
    bad: list[int] = []
    for device in {tensors[i].device for i in found}:
        indices = [i for i in found if tensors[i].device == device]
        if bool(torch.stack([_sum(tensors[i]) for i in indices]).isfinite().all()):
            continue
        finite = torch.stack(torch._foreach_norm([tensors[i].detach() for i in indices], math.inf)).isfinite()
        if not bool(finite.all()):
            bad.append(indices[finite.tolist().index(False)])
    return min(bad, default=None)


def first_nonfinite(named: Iterable[tuple[str, object]]) -> str | None:
    """Name of the first floating tensor with a NaN/inf among ``named`` (nested dicts searched), else None."""
    found = _floating(named)
    index = nonfinite_index([tensor for _, tensor in found])
    return None if index is None else found[index][0]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class NonFiniteGuard:
    """Checks, on every rank just before its optimizer step, that no rank saw a non-finite loss, gradient
    or BatchNorm statistic.

    The ranks agree through one small all-gather; on a bad step every rank drops its
    gradients, so the optimizer step changes nothing, and the step ends normally. Then
    (``end_step``) ``stop`` raises :class:`NonFiniteError` everywhere (the weights in memory
    are still those of the last good step) and ``skip-step`` also restores the BatchNorm
    buffers, so weights, optimizer state and statistics stay as they were.
    """

    def __init__(self, engine: HybridEngine, ctx: Comm, loss: LossWatch,
                 policy: OnNonFinite = OnNonFinite.STOP, hint: str = "") -> None:
        self.engine = engine
        self.ctx = ctx
        self.loss = loss
        self.policy = OnNonFinite(policy)
        self.hint = hint
        self.step = 0
        self.skipped: list[int] = []
        self.in_a_row = 0
        self.bad: str | None = None
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for inst in self.engine.instances.values():
            for name, p in inst.canonical.named_parameters():
                seen.setdefault(id(p), (inst.canonical.full_key(name), p))
        for key, shard in self.engine.named_shards():   # --zero-stage 2-3: the step's gradients are the shards'
            seen.setdefault(id(shard), (f"{key} (shard)", shard))
        return list(seen.values())

    def begin_step(self, step: int) -> None:
        """Step ``step`` (1-based) starts: forget the last one's losses; snapshot buffers to restore on a skip."""
        self.step = step
        self.bad = None
        self.loss.reset()
        if self.policy is OnNonFinite.SKIP_STEP:
            self._buffers = [(b, b.detach().clone()) for _, b in self._buffers_named()]

    def on_action(self, action: Action) -> None:
        """Called before each action: before the optimizer step, agree on the step and drop a bad update."""
        if action.kind is not ActionKind.OPTIM:
            return
        with self.ctx.tracer.span("nonfinite-check gather"):
            grads = _floating((name, p.grad) for name, p in self._params() if p.grad is not None)
            stats = _floating(self._buffers_named())
            every = [t for _, t in grads + stats] + self.loss.losses
            clean = nonfinite_index(every) is None        # the step's one read: every tensor at once
            report = (None, None, None) if clean else (self.loss.bad, first_nonfinite(grads), first_nonfinite(stats))
            reports = self.ctx.all_gather_object(report)
        found = [[(r, report[i]) for r, report in enumerate(reports) if report[i] is not None]
                 for i in range(3)]
        if any(found):
            self.skip()            # the optimizer step then changes nothing; the step ends normally
            self.bad = self.describe(*found)

    def end_step(self, loss: float) -> bool:
        """After the step (global ``loss``): True if it was skipped; NonFiniteError (every rank) to stop."""
        what, self.bad = self.bad, None
        if what is None and math.isfinite(loss):
            self.in_a_row = 0
            return False
        what = what or f"non-finite loss {loss}"
        step = f"step {self.step} (loss {loss:.4g})"
        if self.policy is OnNonFinite.STOP:
            raise NonFiniteError(self.step, f"{step}: {what}; stopped before the optimizer step, so no "
                                            f"non-finite weight was applied or saved. {self.hint}")
        self.in_a_row += 1
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteError(self.step, f"{step}: {what}, {self.in_a_row} steps in a row; "
                                            f"the run has diverged. {self.hint}")
        self.skipped.append(self.step)
        if self.ctx.rank == 0:
            print(f"mpi4dl_nb train: {step}: {what}; step skipped (--on-nonfinite "
                  f"skip-step: weights, optimizer state and BatchNorm statistics unchanged)",
                  file=sys.stderr, flush=True)
        return True

    @staticmethod
    def describe(bad_loss: Sequence[tuple[int, object]], bad_grad: Sequence[tuple[int, object]],
                 bad_stats: Sequence[tuple[int, object]] = ()) -> str:
        parts = []
        if bad_loss:
            parts.append(f"non-finite loss ({bad_loss[0][1]} on {_ranks([r for r, _ in bad_loss])}, "
                         f"the last stage)")
        for what, found in (("gradients", bad_grad), ("BatchNorm statistics", bad_stats)):
            if found:
                parts.append(f"non-finite {what} on {_ranks([r for r, _ in found])} (first: "
                             f"{found[0][1]} on rank {found[0][0]})")
        return " and ".join(parts)

    def _buffers_named(self) -> list[tuple[str, torch.Tensor]]:
        seen: dict[int, tuple[str, torch.Tensor]] = {}
        for inst in self.engine.instances.values():
            for name, b in inst.canonical.named_buffers():
                seen.setdefault(id(b), (inst.canonical.full_key(name), b))
        return list(seen.values())

    def skip(self) -> None:
        """Drop this step's update on this rank: no gradients, buffers as before the step."""
        for _, p in self._params():
            p.grad = None
        with torch.no_grad():
            for live, saved in self._buffers:
                live.copy_(saved)

