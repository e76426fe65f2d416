"""BatchNorm running statistics equal to serial: record each chunk's update, replay in order.

Serial reference: the chunks of a step run one after another in chunk order, each forward
updating ``running = (1 - f) * running + f * batch_stat`` (``f`` = momentum, or
``1/num_batches_tracked`` when momentum is None). In parallel a stage's chunks run on
several holders (tiles, local-DP copies, GEMS mirror, data-parallel replicas) and in
schedule order. Each holder runs every chunk's forward from zeroed buffers, which leaves
exactly ``f * batch_stat`` (``batch_stat`` when momentum is None) — the chunk's term. At the
end of the step the holders of a stage exchange their terms and every holder replays all
terms in chunk order from the running statistics the step started with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, cast

import torch
from torch import nn


class RunningStatsNorm(Protocol):
    """What the ledger uses of a module keeping running statistics (a BatchNorm)."""

    training: bool
    momentum: float | None
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor | None


def running_stat_norms(module: nn.Module) -> list[RunningStatsNorm]:
    """Sub-modules that keep running mean/var (BatchNorm and spatial equivalents)."""
    found = []
    for m in module.modules():
        mean = getattr(m, "running_mean", None)
        var = getattr(m, "running_var", None)
        if isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor):
            found.append(cast(RunningStatsNorm, m))
    return found


Term = list[tuple[torch.Tensor, torch.Tensor] | None]   # per norm: (mean term, var term), None if idle


class RunningStatsLedger:
    """Records the running-statistic term of every chunk a module instance runs.

    During a chunk's forward each norm runs on fresh zero buffers (never the real ones, so
    autograd's saved tensors are never modified in place); afterwards they hold the term.
    """

    def __init__(self, module: nn.Module) -> None:
        self.norms = running_stat_norms(module)
        self.start: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.terms: dict[int, Term] = {}

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
        """Run one chunk's forward inside: its terms are recorded under ``chunk``."""
        active = [m for m in self.norms if m.training and getattr(m, "track_running_stats", True)]
        if not active:
            yield
            return
        originals = [(m.running_mean, m.running_var, _tracked(m)) for m in active]
        for m, (mean, var, tracked) in zip(active, originals):   # fresh zero buffers: tensors
            m.running_mean = torch.zeros_like(mean)                 # saved for backward stay
            m.running_var = torch.zeros_like(var)                   # untouched
            if tracked is not None:
                m.num_batches_tracked = torch.zeros_like(tracked)
        try:
            yield
            self.terms[chunk] = [(m.running_mean, m.running_var) if m in active else None
                                 for m in self.norms]
        finally:
            for m, (mean, var, tracked) in zip(active, originals):
                m.running_mean, m.running_var = mean, var
                if tracked is not None:
                    m.num_batches_tracked = tracked

    def replay(self, terms: dict[int, Term]) -> None:
        """Running statistics after applying ``terms`` in chunk order from the step start."""
        if not self.norms:
            return
        with torch.no_grad():
            for index, m in enumerate(self.norms):
                mean, var, tracked = self.start[index]
                mean, var = mean.clone(), var.clone()
                count = tracked.clone() if tracked is not None else None
                for chunk in sorted(terms):
                    term = terms[chunk][index]
                    if term is None:
                        continue
                    t_mean = term[0].to(mean.device, mean.dtype)
                    t_var = term[1].to(var.device, var.dtype)
                    if count is not None:
                        count += 1
                    if m.momentum is None:
                        factor = 1.0 / float(count.item()) if count is not None else 1.0
                        mean = factor * t_mean + (1.0 - factor) * mean
                        var = factor * t_var + (1.0 - factor) * var
                    else:
                        mean = t_mean + (1.0 - m.momentum) * mean
                        var = t_var + (1.0 - m.momentum) * var
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                live = _tracked(m)
                if count is not None and live is not None:
                    live.copy_(count)


def _tracked(m: RunningStatsNorm) -> torch.Tensor | None:
    value = getattr(m, "num_batches_tracked", None)
    return value if isinstance(value, torch.Tensor) else None


def merge_terms(collected: Sequence[dict[int, Term]]) -> dict[int, Term]:
    """Union of several holders' terms; a chunk seen twice (tiles of one stage) counts once."""
    merged: dict[int, Term] = {}
    for terms in collected:
        for chunk, term in terms.items():
            merged.setdefault(chunk, term)
    return merged


def terms_to_cpu(terms: dict[int, Term]) -> dict[int, Term]:
    """Terms with tensors on the CPU (for object collectives)."""
    return {c: [None if t is None else (t[0].cpu(), t[1].cpu()) for t in term]
            for c, term in terms.items()}
