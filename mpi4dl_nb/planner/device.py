"""Where the planner measures: the device a job runs on, as a Protocol (``MeasuringDevice``: layer
times, copy speed, the cores its ranks share) that ``layer_timer.TorchDevice`` implements on a real
``torch.device`` and a test can stand in for; what it is asked (``TimingRequest``) and answers
(``LayerTime``).

Every prediction measures on the job's device: the ranks' ``ctx.device`` (``tune``, auto-tune,
the one-knob sweep), or the device a caller names for an offline ``suggest`` (default: the one
``dl.init()`` would give this process, CUDA when visible).
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .clock import work_clock
from .footprint import Loss, Shape, StageRole


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one layer's forward and backward on one rank (one chunk), and of its share of
    the engine's work around them, each timed on the engine's own code: ``setup`` (train mode,
    gradients dropped, BatchNorm statistics remembered at the step start), ``gradients``
    (flattened for the stage's all-reduce and copied back, one holder), ``replay`` (BatchNorm
    running statistics replayed from one chunk's terms, ``pipeline.bn_replay``) and
    ``replay_chunk`` (each further chunk), ``optimizer`` (SGD with momentum on its parameters),
    ``terms_exchange`` (one chunk's BatchNorm terms packed for the holders' sum and unpacked,
    ``dataparallel.gather_terms``, when several ranks hold the stage); a layer on a ring member's tokens:
    ``ring_block`` (forward, backward), the seconds of one key/value block's attention (a ring step's compute,
    behind which the next message travels; ``attention.exposed_ring_seconds``)."""

    forward: float
    backward: float
    optimizer: float = 0.0
    replay: float = 0.0
    replay_chunk: float = 0.0
    gradients: float = 0.0
    setup: float = 0.0
    terms_exchange: float = 0.0
    ring_block: tuple[float, float] = (0.0, 0.0)

    @property
    def bookkeeping(self) -> float:
        """The step's tail for one chunk: optimizer update + BatchNorm replay."""
        return self.optimizer + self.replay

    def reduction(self, chunks: int, holders: int = 1) -> float:
        """This layer's local share of a stage's gradient/statistics action over ``chunks`` chunks
        (``holders`` ranks hold the stage: their BatchNorm terms are exchanged too)."""
        exchange = chunks * self.terms_exchange if holders > 1 else 0.0
        return self.gradients + self.replay + max(0, chunks - 1) * self.replay_chunk + exchange


@dataclass(frozen=True)
class TimingRequest:
    """A layer to time: on inputs of ``shapes`` in ``dtype``, in ``role`` (a spatial stage's tile
    or whole maps), with the ``loss`` applied to its output when it is the model's last layer
    (``loss_key`` names that loss for the cache); ``images``: its inputs are the step's images, which need
    no gradient (the first layer of the first stage: no input gradient computed, as in the engine)."""

    layer: nn.Module
    shapes: tuple[Shape, ...]
    dtype: torch.dtype
    role: StageRole
    loss: Loss | None = None
    loss_key: Hashable = None
    images: bool = False


class MeasuringDevice(Protocol):
    """Where layer times and copy speed are measured: the device the job runs on."""

    @property
    def device(self) -> torch.device: ...

    def time_layers(self, pending: Sequence[tuple[TimingRequest, int]], repeats: int,
                    threads: int) -> list[LayerTime]:
        """Each (request, tile)'s times: every layer built, then run once per round, ``repeats``
        rounds after a warm-up, with ``threads`` torch threads; each phase's median kept."""
        ...

    def copy_bandwidth(self) -> float:
        """Bytes per second of a tensor copy on the device."""
        ...

    def cores(self) -> int | None:
        """The CPU cores the job's ranks share on a node; None: a device (GPU) per rank."""
        ...


def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 16 * 2 ** 20, repeats: int = 5) -> float:
    """Bytes per second of a tensor copy on ``device`` (median of ``repeats``)."""
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty_like(source)
    runs = []
    for _ in range(repeats + 1):
        start = work_clock(device)
        target.copy_(source)
        runs.append(work_clock(device) - start)
    return nbytes / max(1e-9, statistics.median(runs[1:]))
