"""Footprints as records: what one layer, and one stage, allocate for one chunk on one rank (bytes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass, field, replace

import torch

from ..config import Choice
from .attention import TokenGrid
from .fake_world import Traffic

Shape = tuple[int, ...]
Loss = Callable[[torch.Tensor], torch.Tensor]   # the last layer's output -> the loss whose backward runs


@dataclass(frozen=True)
class StageRole:
    """How a stage runs on its ranks: whole maps, or tiles of ``grid`` (rows, cols)."""

    grid: tuple[int, int] | None = None
    halo_d2: bool = False
    fused_layers: int = 1
    tokens: TokenGrid | None = None   # a ViT's stage: the image's tokens, each tile's part on its rank

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1] if self.grid is not None else 1


class SplitRun(Choice):
    """Whether a layer's simulation adds the split backward's terms, and how its I runs."""

    NONE = "none"                # no split backward (every schedule but zb1/zbv, and their first stage)
    SPLIT = "split"              # I computes the input's gradient and the layers' output gradients, W the rest


@dataclass(frozen=True)
class SplitTerms:
    """One layer run as the engine's split backward (pipeline/split_backward.py: ``input_backward`` then
    ``WeightWork.run``), bytes: ``kept`` the output gradients its I leaves for W (each storage once: an add
    hands both branches the same gradient); ``input_peak`` the I's worst moment above the forward's held
    tensors (its output gradient, the kept gradients made so far, the input gradient, scratch; nothing the
    forward saved is freed: the graph is retained for W); ``released`` what the forward held (its output
    included) that goes once I is over (the nodes after the last parameter module: only ``out`` held
    them); ``weight_peak`` the W's worst moment above what it starts with (its parameter gradients
    included); ``kept_received``: of ``kept``, the output gradient it was handed (a layer ending in an
    add, or in a parameter module, keeps it as its last module's output gradient)."""

    kept: int = 0
    input_peak: int = 0
    released: int = 0
    weight_peak: int = 0
    kept_received: int = 0

    def times(self, samples: float) -> SplitTerms:
        return SplitTerms(*(round(value * samples) for value in astuple(self)))


@dataclass(frozen=True)
class LayerFootprint:
    """One layer, one chunk, one rank (bytes; activations in the simulated dtype).

    ``forward_peak`` counts what the forward allocates (its output included) at its
    worst moment; ``kept`` what it holds for its backward besides its input and output;
    ``backward_peak`` the worst moment of its backward counting ``kept``, its output, the
    output gradient and what backward allocates (its parameter gradients included).
    """

    input_bytes: int
    output_bytes: int
    forward_peak: int
    kept: int
    halo_kept: int          # part of ``kept``: received halo strips saved for backward
    saves_input: bool
    saves_output: bool
    backward_peak: int
    input_grad_bytes: int
    grad_bytes: int
    persistent: int         # what the layer keeps across steps (halo staging buffers, caches)
    forward_traffic: Traffic = field(default_factory=Traffic)
    backward_traffic: Traffic = field(default_factory=Traffic)
    strips_received: int = 0   # halo strips the forward received (a recomputation log keeps them all)
    forward_fixed: int = 0     # of ``forward_peak``, bytes that do not grow with the batch (backend scratch)
    backward_fixed: int = 0    # of ``backward_peak``, the same
    split: SplitTerms = field(default_factory=SplitTerms)   # the engine's split backward (zb1/zbv), if simulated

    @property
    def replay_log(self) -> int:
        """What ``spatial/replay.py`` keeps of this layer's first forward for its recomputation:
        the received halo strips and the BatchNorm statistics (the forward's all-reduced sums)."""
        return self.strips_received + self.forward_traffic.collective_bytes

    def times(self, samples: float) -> LayerFootprint:
        """This footprint (one sample) for ``samples``: every activation term scales with the
        batch; parameter gradients and the backend's fixed scratch do not (per-channel statistics
        are neglected). A fraction scales a per-token layer to a tile's share of the tokens."""
        def n(value: int) -> int:
            return round(value * samples)
        fixed_backward = self.grad_bytes + self.backward_fixed
        return LayerFootprint(
            n(self.input_bytes), n(self.output_bytes), n(self.forward_peak - self.forward_fixed) + self.forward_fixed,
            n(self.kept), n(self.halo_kept), self.saves_input, self.saves_output,
            n(self.backward_peak - fixed_backward) + fixed_backward,
            n(self.input_grad_bytes), self.grad_bytes, n(self.persistent),
            _traffic_times(self.forward_traffic, samples), _traffic_times(self.backward_traffic, samples),
            n(self.strips_received), self.forward_fixed, self.backward_fixed, self.split.times(samples))


def _traffic_times(traffic: Traffic, samples: float) -> Traffic:
    return replace(traffic, message_bytes=round(traffic.message_bytes * samples))


@dataclass(frozen=True)
class StageFootprint:
    """One chunk of one stage on one rank, composed from its layers (``stage_compose.py``).

    ``retained``: kept from the forward to the backward (the output included, the input
    not); ``backward_first``/``backward_later``: worst moment of the backward, gradients of
    the stage's parameters excluded, for the first chunk (the layers after the running one
    have created theirs: included) and a later one (all exist: counted by the caller).
    """

    input_bytes: int
    output_bytes: int
    forward_peak: int
    retained: int
    kept_by_layer: tuple[int, ...]
    halo_kept: int
    backward_first: int
    backward_later: int
    input_grad_bytes: int
    grad_bytes: int
    persistent: int
    layers: tuple[LayerFootprint, ...] = ()
    recomputed: int = 0     # part of the backward peaks: activations of a recomputed forward
    split: SplitStage | None = None   # the chunk under the engine's split backward (simulated with split=True)

    @property
    def saved(self) -> int:
        """Retained bytes other than the stage output."""
        return self.retained - self.output_bytes


@dataclass(frozen=True)
class SplitStage:
    """One chunk of a stage under the engine's split backward (from its layers' ``SplitTerms``), bytes.

    ``input_peak``: the I's worst moment, counting the chunk's held tensors (as ``backward_first`` does:
    the output and received gradient included, the input not); ``held``: what the forward kept that the
    retained graph still holds after I (the stage output only if a node before the last parameter module
    saved it); ``kept``: the output gradients kept for W; ``keeps_input``: whether the graph still holds
    the stage input (its first layer saved it; else it went with I); ``weight_peak``: the W's working
    memory above the chunk's held tensors."""

    input_peak: int
    held: int
    kept: int
    keeps_input: bool
    weight_peak: int
