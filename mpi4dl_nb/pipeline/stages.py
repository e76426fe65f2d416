"""Stages: cut a layer list into consecutive stages by ``balance`` or by profiled cost.

Automatic balance profiles each layer once on a sample batch, either by **time**
(forward + backward wall time, median of a few runs) or by **memory** (bytes autograd
saves for backward plus the layer's parameters, counted by ``layer_memory``'s rule, which
the memory planner uses too), then cuts the list into contiguous stages that minimise the
largest stage cost. The cut a configuration gets without ``balance`` is ``default_cut.default_balance``,
which asks ``probe_memory`` (``layer_memory`` shape-only at a probe size, kept for the last few models).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm.messages import Payload, as_items, like
from ..config import ConfigError
from ..spatial.fit import meta_copy
from .layer_memo import LayerMemo
from .tile_fit import PROBE_ERRORS, first_layer_channels, parameter_dtype

Activation = Payload  # a tensor or a tuple of tensors (skip connections)
PROBE_SIZE = 256   # image side the default cut profiles memory at (shape-only, on meta)


class Stage(nn.Sequential):
    """Consecutive layers ``offset .. offset+len-1`` of the whole model, run in order.

    Like ``nn.Sequential`` each layer gets the previous layer's output, a tensor or a
    tuple; ``full_key`` maps this stage's state-dict keys to those of the whole model.
    """

    def __init__(self, layers: Sequence[nn.Module], offset: int, index: int = 0) -> None:
        super().__init__(*layers)
        self.offset = offset
        self.index = index

    def full_key(self, key: str) -> str:
        """``'0.weight'`` -> ``'<offset>.weight'``: the key in ``nn.Sequential(*layers)``."""
        local, _, rest = key.partition(".")
        return f"{int(local) + self.offset}.{rest}"

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state with whole-model keys (tensors detached, on CPU)."""
        return {self.full_key(k): v.detach().cpu().clone() for k, v in self.state_dict().items()}

    def load_from_full(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's entries of a whole-model state dict in place."""
        own = {k: state[self.full_key(k)] for k in self.state_dict() if self.full_key(k) in state}
        missing = [self.full_key(k) for k in self.state_dict() if self.full_key(k) not in state]
        if missing:
            raise KeyError(f"stage {self.index}: state dict lacks {missing[:4]}")
        with torch.no_grad():
            for key, value in self.state_dict(keep_vars=True).items():
                value.copy_(own[key].to(value.device, value.dtype))


def even_balance(num_layers: int, split_size: int) -> tuple[int, ...]:
    """Layer counts per stage as even as possible; the later stages take the remainder."""
    if split_size < 1 or num_layers < split_size:
        raise ConfigError("split_size", f"cannot cut {num_layers} layers into {split_size} "
                          f"stages; use split_size between 1 and {num_layers}")
    base, extra = divmod(num_layers, split_size)
    return tuple(base + (1 if s >= split_size - extra else 0) for s in range(split_size))


def check_balance(balance: Sequence[int], num_layers: int, split_size: int) -> tuple[int, ...]:
    """Validate a user balance; ConfigError names the fix."""
    balance = tuple(int(b) for b in balance)
    if len(balance) != split_size:
        raise ConfigError("balance", f"has {len(balance)} entries but split_size={split_size}; "
                          f"give one layer count per stage, e.g. "
                          f"{list(even_balance(num_layers, split_size))}")
    if any(b < 1 for b in balance) or sum(balance) != num_layers:
        raise ConfigError("balance", f"{list(balance)} must be positive and sum to the "
                          f"{num_layers} layers, e.g. {list(even_balance(num_layers, split_size))}")
    return balance


def split_layers(layers: Sequence[nn.Module], split_size: int,
                 balance: Sequence[int] | None = None) -> list[Stage]:
    """Cut ``layers`` into ``split_size`` Stages (``balance`` layer counts, or even)."""
    layers = list(layers)
    counts = even_balance(len(layers), split_size) if balance is None else \
        check_balance(balance, len(layers), split_size)
    stages, offset = [], 0
    for index, count in enumerate(counts):
        stages.append(Stage(layers[offset:offset + count], offset, index))
        offset += count
    return stages


def partition_costs(costs: Sequence[float], split_size: int) -> tuple[int, ...]:
    """Contiguous cut of ``costs`` into ``split_size`` non-empty parts minimising the max sum.

    Ties go to the cut whose later stages are lighter. Exact dynamic program, O(n^2 k).
    """
    n = len(costs)
    if not 1 <= split_size <= n:
        raise ConfigError("split_size", f"cannot cut {n} layers into {split_size} stages; "
                          f"use split_size between 1 and {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal max-cost of cutting the first i layers into k parts
    best = [[inf] * (n + 1) for _ in range(split_size + 1)]
    cut = [[0] * (n + 1) for _ in range(split_size + 1)]
    best[0][0] = 0.0
    for k in range(1, split_size + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    return counts_from_cuts(cut, split_size, n)


def counts_from_cuts(cut: list[list[int]], split_size: int, num_layers: int) -> tuple[int, ...]:
    """Layers per stage, read back from a partition program's ``cut[k][i]`` (where stage k
    starts when k stages hold the first i layers)."""
    counts, i = [], num_layers
    for k in range(split_size, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def _float_tensors(value: Activation) -> list[torch.Tensor]:
    return [t for t in as_items(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _detach_input(value: Activation) -> Activation:
    """``value`` with each float tensor a fresh leaf that requires grad (others as they are)."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(True) if t.is_floating_point() else t
    return like(value, [leaf(t) if isinstance(t, torch.Tensor) else t for t in as_items(value)])


def _backward_all(output: Activation) -> None:
    outs = [t for t in _float_tensors(output) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def profile_layer_times(layers: Sequence[nn.Module], sample: Activation,
                        repeats: int = 3) -> list[float]:
    """Seconds of forward + backward per layer on ``sample`` (median of ``repeats``).

    Runs on copies of the layers, so their BatchNorm statistics and gradients stay untouched.
    """
    layers = [copy.deepcopy(layer) for layer in layers]
    times: list[float] = []
    x = sample
    for layer in layers:
        runs = []
        for _ in range(max(1, repeats)):
            inp = _detach_input(x)
            start = time.perf_counter()
            out = layer(inp)
            _backward_all(out)
            runs.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        times.append(sorted(runs)[len(runs) // 2])
        with torch.no_grad():
            x = layer(_detach_input(x))
    return times


@dataclass(frozen=True)
class LayerMemory:
    """One layer's training memory under the counting rule of :func:`layer_memory` (bytes)."""

    saved_bytes: int                   # activations autograd keeps for backward
    param_bytes: int
    outputs: tuple[torch.Tensor, ...]  # the layer's output tensors (meta: shapes only)

    @property
    def total(self) -> int:
        return self.saved_bytes + self.param_bytes


Instrument = Callable[[int, nn.Module], Sequence[RemovableHandle]]


def layer_memory(layers: Sequence[nn.Module], sample: Activation, *,
                 dtype: torch.dtype | None = None,
                 instrument: Instrument | None = None) -> list[LayerMemory]:
    """Per layer of ``nn.Sequential(*layers)`` on ``sample``: bytes saved for backward and parameters.

    The counting rule (the one the planner and ``auto_balance(by="memory")`` share): a
    layer is charged the tensors autograd saves during its training-mode forward, each by
    its own size (elements x element size); parameters are not activations (they are
    ``param_bytes``), 0-d tensors are ignored, and a tensor saved by several layers (a ReLU
    output the next conv saves too) is charged once, to the first layer that saves it.

    Runs shape-only on ``meta`` copies of the layers (no memory, no data; the originals
    and their BatchNorm statistics are untouched), in ``dtype`` if given. Float inputs
    require grad, as in training. ``instrument(index, layer_copy)`` may register hooks on
    a copy before it runs (the planner counts FLOPs so) and returns their handles.
    """
    def to_meta(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t.detach().to(device="meta")
        return t.detach().to(device="meta", dtype=dtype or t.dtype).requires_grad_(True)

    x = like(sample, [to_meta(t) if isinstance(t, torch.Tensor) else t for t in as_items(sample)])
    seen: dict[int, torch.Tensor] = {}     # keeps counted tensors alive, so ids stay unique
    found = []
    for index, layer in enumerate(layers):
        meta_layer = meta_copy(layer)
        if dtype is not None:
            meta_layer.to(dtype=dtype)
        meta_layer.train()
        param_ids = {id(p) for p in meta_layer.parameters()}
        saved: list[int] = []

        def pack(t: torch.Tensor, param_ids: set[int] = param_ids, saved: list[int] = saved
                 ) -> torch.Tensor:
            if id(t) not in param_ids and id(t) not in seen and t.dim() > 0:
                seen[id(t)] = t
                saved.append(_nbytes(t))
            return t

        handles = instrument(index, meta_layer) if instrument is not None else ()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x = meta_layer(x)
        finally:
            for handle in handles:
                handle.remove()
        params = sum(_nbytes(p) for p in meta_layer.parameters())
        outputs = tuple(t for t in as_items(x) if isinstance(t, torch.Tensor))
        found.append(LayerMemory(sum(saved), params, outputs))
    return found


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# the memory probes of the last few models: the pre-flight check, the engine and the planner's cuts ask alike
_PROBED: LayerMemo[list[LayerMemory] | None] = LayerMemo()


def probe_memory(layers: Sequence[nn.Module], probe_size: int = PROBE_SIZE) -> list[LayerMemory] | None:
    """``layer_memory`` of ``layers`` on a ``probe_size`` square image (meta), or None if the
    input channels cannot be told (no conv) or the layers fail at that size. The last few results
    are kept (for the same layer objects, unchanged)."""
    return _PROBED.get(layers, probe_size, lambda: _probed_memory(layers, probe_size))


def _probed_memory(layers: Sequence[nn.Module], probe_size: int) -> list[LayerMemory] | None:
    channels = first_layer_channels(layers)
    if channels is None:
        return None
    sample = torch.empty(1, channels, probe_size, probe_size, dtype=parameter_dtype(layers), device="meta")
    try:
        return layer_memory(layers, sample)
    except PROBE_ERRORS:
        return None


def profile_layer_memory(layers: Sequence[nn.Module], sample: Activation) -> list[int]:
    """Bytes per layer on ``sample``: saved activations + parameters, by :func:`layer_memory`'s rule."""
    return [m.total for m in layer_memory(layers, sample)]


def auto_balance(layers: Sequence[nn.Module], sample: Activation, split_size: int,
                 by: str = "time", repeats: int = 3) -> tuple[int, ...]:
    """A balance for ``split_size`` stages from profiling ``by`` 'time' or 'memory'."""
    profilers: dict[str, Callable[[], Sequence[float]]] = {
        "time": lambda: profile_layer_times(layers, sample, repeats),
        "memory": lambda: profile_layer_memory(layers, sample),
    }
    if by not in profilers:
        raise ValueError(f"auto_balance by={by!r}: use 'time' or 'memory'")
    return partition_costs(profilers[by](), split_size)
