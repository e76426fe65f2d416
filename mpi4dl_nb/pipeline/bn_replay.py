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
        norm = self.norms[index]
        module = cast(nn.Module, norm)
        scratch: list[torch.Tensor] = []     # the counter a norm with a momentum increments unread (made once)

        def before(module_: nn.Module, args: tuple[object, ...]) -> None:
            if self._recording is None or not (norm.training and getattr(norm, "track_running_stats", True)):
                return
            tracked = _tracked(norm)
            self._saved.append((index, norm.running_mean, norm.running_var, tracked))
            _put_buffer(module, "running_mean", torch.zeros_like(norm.running_mean))
            _put_buffer(module, "running_var", torch.zeros_like(norm.running_var))
            if tracked is not None:
                _put_buffer(module, "num_batches_tracked", _counter(norm, tracked, scratch))
        return before

    def _after_hook(self, index: int) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        norm = self.norms[index]
        module = cast(nn.Module, norm)

        def after(module_: nn.Module, args: tuple[object, ...], output: object) -> None:
            if not self._saved or self._saved[-1][0] != index:
                return
            _, mean, var, tracked = self._saved.pop()
            if self._recording is not None:
                self._recording[index].append((norm.running_mean, norm.running_var))
            _put_buffer(module, "running_mean", mean)
            _put_buffer(module, "running_var", var)
            if tracked is not None:
                _put_buffer(module, "num_batches_tracked", tracked)
        return after

    def replay(self, terms: dict[int, Term]) -> None:
        """Running statistics after applying ``terms`` in chunk and call order from the step start.

        Norms with a momentum ``f`` update ``running = term + (1 - f) * running`` per call: those of one ``f``,
        dtype and device are updated together, their means and variances side by side in one flat tensor (an
        elementwise op gives each element what it gives one norm's buffer); a cumulative average (momentum None)
        divides by its own count and is replayed one norm at a time."""
        if not self.norms:
            return
        chunks = sorted(terms)
        with torch.no_grad():
            groups: dict[tuple[float, torch.dtype, torch.device], list[int]] = {}
            for index, m in enumerate(self.norms):
                if m.momentum is None and _counts_batches(m) and self.start[index][2] is not None:
                    self._replay_cumulative(index, [call for chunk in chunks for call in terms[chunk][index]])
                else:
                    mean = self.start[index][0]
                    groups.setdefault((1.0 - (m.momentum or 0.0), mean.dtype, mean.device), []).append(index)
            for (keep, _, _), indices in groups.items():
                self._replay_exponential(keep, indices, [[terms[chunk][i] for i in indices] for chunk in chunks])

    def _replay_exponential(self, keep: float, indices: list[int], calls: list[list[list[Call]]]) -> None:
        """Norms ``indices`` (momentum ``1 - keep``, one dtype and device) after their ``calls`` (per chunk, per
        norm, in order), in one flat tensor: every mean, then every variance."""
        widths = [self.start[i][0].numel() for i in indices]
        total = sum(widths)
        offsets = [sum(widths[:j]) for j in range(len(indices))]
        flat = torch.cat([self.start[i][0] for i in indices] + [self.start[i][1] for i in indices])
        counted = [0] * len(indices)
        for per_norm in calls:
            for call in range(max((len(c) for c in per_norm), default=0)):
                place = [j for j, c in enumerate(per_norm) if len(c) > call]
                for j in place:
                    counted[j] += 1
                if len(place) == len(indices):          # every norm of the group: one update of the whole
                    found = torch.cat([per_norm[j][call][0] for j in place] + [per_norm[j][call][1] for j in place])
                    flat.mul_(keep).add_(_like(found, flat))
                    continue
                for j in place:                          # a norm called more often than the others
                    for part, term in ((0, per_norm[j][call][0]), (total, per_norm[j][call][1])):
                        piece = flat[part + offsets[j]:part + offsets[j] + widths[j]]
                        piece.mul_(keep).add_(_like(term, piece))
        norms = [self.norms[i] for i in indices]
        torch._foreach_copy_([m.running_mean for m in norms] + [m.running_var for m in norms],
                             list(flat[:total].split(widths)) + list(flat[total:].split(widths)))
        counters = [(live, start, count) for i, m, count in zip(indices, norms, counted)
                    if (live := _tracked(m)) is not None and (start := self.start[i][2]) is not None
                    and _counts_batches(m)]
        if counters:
            torch._foreach_copy_([live for live, _, _ in counters],
                                 torch._foreach_add([start for _, start, _ in counters], [c for _, _, c in counters]))

    def _replay_cumulative(self, index: int, calls: list[Call]) -> None:
        """Norm ``index`` (momentum None: each call weighs ``1 / count``) after ``calls`` in order."""
        m = self.norms[index]
        mean, var, tracked = self.start[index]
        assert tracked is not None
        count = tracked.clone()
        for t_mean, t_var in calls:
            count += 1
            factor = 1.0 / count.to(mean.dtype)       # stays on the device
            mean = factor * _like(t_mean, mean) + (1.0 - factor) * mean
            var = factor * _like(t_var, var) + (1.0 - factor) * var
        m.running_mean.copy_(mean)
        m.running_var.copy_(var)
        live = _tracked(m)
        if live is not None:
            live.copy_(count)


def _like(term: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``term`` on ``like``'s device and dtype (a gathered term arrives in float64)."""
    return term if term.dtype == like.dtype and term.device == like.device else term.to(like.device, like.dtype)


def _put_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set buffer ``name`` (straight into the module's buffer table: ``nn.Module.__setattr__`` re-registers a
    buffer on every assignment, a cost on every call of every norm)."""
    buffers = module._buffers
    if name in buffers:
        buffers[name] = value
    else:
        setattr(module, name, value)


def _counter(norm: RunningStatsNorm, tracked: torch.Tensor, scratch: list[torch.Tensor]) -> torch.Tensor:
    """The ``num_batches_tracked`` a recorded call of ``norm`` runs on: zero when the call reads it (momentum
    None: its factor is ``1 / count``), else the norm's scratch counter (made on first use, like ``tracked``)."""
    if norm.momentum is None:
        return torch.zeros_like(tracked)
    if not scratch or scratch[0].device != tracked.device:
        scratch[:] = [torch.zeros_like(tracked)]
    return scratch[0]


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
