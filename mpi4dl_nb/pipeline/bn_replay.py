"""BatchNorm running statistics equal to serial: record each chunk's updates, replay in order.

Serial reference: the chunks of a step run one after another in chunk order; every call of
a norm updates ``running = (1 - f) * running + f * batch_stat`` (``f`` = momentum, or
``1/num_batches_tracked`` when momentum is None) — a norm used twice in a forward updates
twice. In parallel a stage's chunks run on several holders (tiles, local-DP copies, GEMS
mirror, data-parallel replicas) and in schedule order. Each holder runs every call of a
norm on fresh zero buffers (forward hooks swap them in and out), which leaves exactly that
call's term ``f * batch_stat`` (``batch_stat`` when momentum is None). At the end of the step
the holders of a stage exchange their terms and every holder replays all of them, chunk by
chunk and call by call, from the running statistics the step started with. Terms stay on
the device; the exchange moves them as one tensor (``dataparallel.gather_terms``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, cast

import torch
from torch import nn


class RunningStatsNorm(Protocol):
    """What the ledger uses of a module keeping running statistics (a BatchNorm, InstanceNorm)."""

    training: bool
    momentum: float | None
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor | None


def running_stat_norms(module: nn.Module) -> list[RunningStatsNorm]:
    """Sub-modules that keep running mean/var (BatchNorm, InstanceNorm and spatial equivalents)."""
    found = []
    for m in module.modules():
        mean = getattr(m, "running_mean", None)
        var = getattr(m, "running_var", None)
        if isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor):
            found.append(cast(RunningStatsNorm, m))
    return found


def _counts_batches(m: RunningStatsNorm) -> bool:
    """Whether a training call increments ``num_batches_tracked`` (BatchNorm yes, InstanceNorm no)."""
    return (not isinstance(m, nn.modules.instancenorm._InstanceNorm)
            and isinstance(getattr(m, "num_batches_tracked", None), torch.Tensor))


Call = tuple[torch.Tensor, torch.Tensor]   # (mean term, var term) of one call of one norm
Term = list[list[Call]]                    # per norm, its calls in this chunk (in order)


class RunningStatsLedger:
    """Records the running-statistic terms of every call of every norm, per chunk.

    Outside ``chunk()`` the norms behave normally; inside, each call runs on fresh zero
    buffers (never the real ones, so tensors autograd saved are never modified in place)
    and its term is appended to the chunk's record.
    """

    def __init__(self, module: nn.Module) -> None:
        self.norms = running_stat_norms(module)
        self.start: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.terms: dict[int, Term] = {}
        self._recording: Term | None = None
        self._saved: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        for index, m in enumerate(self.norms):
            module_ = cast(nn.Module, m)
            module_.register_forward_pre_hook(self._before_hook(index))
            module_.register_forward_hook(self._after_hook(index), always_call=True)

    def __bool__(self) -> bool:
        return bool(self.norms)

    def begin_step(self) -> None:
        """Remember the statistics the step starts from; forget old terms."""
        self.terms = {}
        self.start = []
        for m in self.norms:
            tracked = _tracked(m)
            self.start.append((m.running_mean.detach().clone(), m.running_var.detach().clone(),
                               tracked.detach().clone() if tracked is not None else None))

    @contextmanager
    def chunk(self, chunk: int) -> Iterator[None]:
        """Run one chunk's forward inside: its norms' terms are recorded under ``chunk``."""
        record: Term = [[] for _ in self.norms]
        self._recording = record
        try:
            yield
        finally:
            self._recording = None
        if any(record):
            self.terms[chunk] = record

    def _before_hook(self, index: int) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def before(module: nn.Module, args: tuple[object, ...]) -> None:
            m = self.norms[index]
            if self._recording is None or not (m.training and getattr(m, "track_running_stats", True)):
                return
            tracked = _tracked(m)
            self._saved.append((index, m.running_mean, m.running_var, tracked))
            m.running_mean = torch.zeros_like(m.running_mean)
            m.running_var = torch.zeros_like(m.running_var)
            if tracked is not None:
                m.num_batches_tracked = torch.zeros_like(tracked)
        return before

    def _after_hook(self, index: int) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def after(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if not self._saved or self._saved[-1][0] != index:
                return
            _, mean, var, tracked = self._saved.pop()
            m = self.norms[index]
            if self._recording is not None:
                self._recording[index].append((m.running_mean, m.running_var))
            m.running_mean, m.running_var = mean, var
            if tracked is not None:
                m.num_batches_tracked = tracked
        return after

    def replay(self, terms: dict[int, Term]) -> None:
        """Running statistics after applying ``terms`` in chunk and call order from the step start."""
        if not self.norms:
            return
        with torch.no_grad():
            for index, m in enumerate(self.norms):
                mean, var, tracked = self.start[index]
                mean, var = mean.clone(), var.clone()
                count = tracked.clone() if tracked is not None else None
                counts = _counts_batches(m)
                momentum = m.momentum
                for chunk in sorted(terms):
                    for t_mean, t_var in terms[chunk][index]:
                        t_mean = t_mean.to(mean.device, mean.dtype)
                        t_var = t_var.to(var.device, var.dtype)
                        if counts and count is not None:
                            count += 1
                        if momentum is None and counts and count is not None:
                            factor = 1.0 / count.to(mean.dtype)       # stays on the device
                            mean = factor * t_mean + (1.0 - factor) * mean
                            var = factor * t_var + (1.0 - factor) * var
                        else:
                            keep = 1.0 - (momentum or 0.0)
                            mean = t_mean + keep * mean
                            var = t_var + keep * var
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                live = _tracked(m)
                if count is not None and live is not None:
                    live.copy_(count)


def _tracked(m: RunningStatsNorm) -> torch.Tensor | None:
    value = getattr(m, "num_batches_tracked", None)
    return value if isinstance(value, torch.Tensor) else None


def merge_terms(collected: Sequence[dict[int, Term]]) -> dict[int, Term]:
    """Union of several holders' terms; a chunk seen twice (tiles of one stage, or the
    synchronised copies of one micro-batch) counts once."""
    merged: dict[int, Term] = {}
    for terms in collected:
        for chunk, term in terms.items():
            merged.setdefault(chunk, term)
    return merged
