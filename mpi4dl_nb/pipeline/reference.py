"""The serial run a parallel configuration is exact against: the global batch in the engine's chunks, on one process.

``serial_reference(cfg, layers, batches, loss_fn=..., optimizer=...)`` trains ``nn.Sequential(*layers)`` the
way docs/engine.md defines the reference: each step cuts the global batch into the engine's chunks
(``serial_chunks``), back-propagates ``loss_fn(model(x_j), y_j) * |chunk| / B`` chunk after chunk (gradient
accumulation; BatchNorm sees one chunk at a time, exactly as on the ranks), then takes one optimizer step.
With one chunk (plain LP, spatial without ``parts``) this is ordinary full-batch training. With ``accumulate=N``
(gradient accumulation, ``HybridEngine.train_accumulated``) N consecutive batches make one optimizer step: each
batch's chunks as above, its gradients weighted 1/N, BatchNorm normalising each batch by its own statistics and
updating its running statistics once per batch; the step's loss is the batches' mean.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import ParallelConfig
from .schedules import chunk_index

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def serial_chunks(cfg: ParallelConfig, batch_size: int) -> list[list[int]]:
    """Sample indices of the serial reference's micro-batches, in the order it runs them.

    Without ``sync_batchnorm``: the ``cfg.batch_divisor`` equal consecutive chunks. With it: per GEMS
    chunk and micro-batch, the union of every full replica's and local-DP copy's chunk (they normalise
    together), ordered as the engine replays them.
    """
    cfg.validate(batch_size=batch_size)
    size = batch_size // cfg.batch_divisor
    rows = [list(range(c * size, (c + 1) * size)) for c in range(cfg.batch_divisor)]
    if not cfg.sync_batchnorm:
        return rows
    groups: dict[int, list[int]] = {}
    for replica in ((0, 1) if cfg.gems else (0,)):
        for micro_batch in range(max(cfg.times, 1) * cfg.parts):
            key = chunk_index(cfg, 0, replica, micro_batch, 0)
            groups[key] = [i for d in range(cfg.data_parallel) for k in range(cfg.local_dp)
                           for i in rows[chunk_index(cfg, d, replica, micro_batch, k)]]
    return [groups[k] for k in sorted(groups)]


@dataclass
class SerialRun:
    """A finished serial reference: the model after its steps, each step's loss and wall time."""

    model: nn.Sequential
    chunks: list[list[int]]
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights, BatchNorm statistics and counters, keyed as ``nn.Sequential(*layers)``."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def images_per_second(self, batch_size: int) -> float:
        """Mean throughput over the steps (``batch_size`` images per step)."""
        return batch_size * len(self.step_seconds) / sum(self.step_seconds)


def backward_chunks(model: nn.Module, loss_fn: LossFn, images: torch.Tensor, labels: torch.Tensor,
                    chunks: Sequence[Sequence[int]], weight: float = 1.0) -> float:
    """Back-propagate every chunk's loss scaled by ``|chunk| / batch * weight``; the batch's loss times ``weight``."""
    total = 0.0
    for rows in chunks:
        index = torch.tensor(list(rows))
        loss = loss_fn(model(images[index]), labels[index]) * (len(rows) / images.shape[0] * weight)
        loss.backward()
        total += loss.item()
    return total


def serial_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, images: torch.Tensor,
                labels: torch.Tensor, chunks: Sequence[Sequence[int]]) -> float:
    """One reference step: accumulate every chunk's scaled loss gradient, then one optimizer step; the loss."""
    return serial_accumulated_step(model, optimizer, loss_fn, [(images, labels)], chunks)


def serial_accumulated_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                            batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                            chunks: Sequence[Sequence[int]]) -> float:
    """One optimizer step over ``batches`` (micro-steps, each cut into ``chunks``, weighted ``1 / len(batches)``);
    the mean of their losses."""
    optimizer.zero_grad(set_to_none=True)
    total = sum(backward_chunks(model, loss_fn, images, labels, chunks, 1 / len(batches))
                for images, labels in batches)
    optimizer.step()
    return total


def serial_reference(cfg: ParallelConfig, layers: Iterable[nn.Module],
                     batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, loss_fn: LossFn,
                     optimizer: OptimizerFactory, accumulate: int = 1) -> SerialRun:
    """Train ``layers`` (in place, as ``nn.Sequential``) on ``batches`` the way ``HybridEngine(layers, cfg)``
    must: same chunks, same order; compare its ``losses`` and ``state_dict()`` with the engine's. ``accumulate``:
    batches per optimizer step (``train_accumulated``; a last incomplete group is a shorter step)."""
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")
    model = nn.Sequential(*layers)
    opt = optimizer(model.parameters())
    run = SerialRun(model, [])
    group: list[tuple[torch.Tensor, torch.Tensor]] = []
    for images, labels in batches:
        group.append((images, labels))
        if len(group) == accumulate:
            _timed_step(run, cfg, opt, loss_fn, group)
            group = []
    if group:
        _timed_step(run, cfg, opt, loss_fn, group)
    return run


def _timed_step(run: SerialRun, cfg: ParallelConfig, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    run.chunks = serial_chunks(cfg, batches[0][0].shape[0])
    start = time.perf_counter()
    run.losses.append(serial_accumulated_step(run.model, optimizer, loss_fn, batches, run.chunks))
    run.step_seconds.append(time.perf_counter() - start)
