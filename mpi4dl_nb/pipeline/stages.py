"""Stages: cut a layer list into consecutive stages by ``balance`` or by profiled cost.

Automatic balance profiles each layer once on a sample batch, either by **time**
(forward + backward wall time, median of a few runs) or by **memory** (bytes autograd
saves for backward plus the layer's parameters), then cuts the list into contiguous
stages that minimise the largest stage cost.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..config import ConfigError

Activation = Any  # a tensor or a tuple of tensors (skip connections)


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
    counts, i = [], n
    for k in range(split_size, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def _float_tensors(value: Activation) -> list[torch.Tensor]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _detach_input(value: Activation) -> Activation:
    if isinstance(value, (tuple, list)):
        return type(value)(_detach_input(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


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


def profile_layer_memory(layers: Sequence[nn.Module], sample: Activation) -> list[int]:
    """Bytes per layer on ``sample``: tensors autograd saves for backward + parameters.

    Runs on copies of the layers, so their BatchNorm statistics stay untouched.
    """
    layers = [copy.deepcopy(layer) for layer in layers]
    sizes: list[int] = []
    x = sample
    for layer in layers:
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(_detach_input(x))
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(sum(saved.values()) + params)
        x = _detach_input(out)
    return sizes


def auto_balance(layers: Sequence[nn.Module], sample: Activation, split_size: int,
                 by: str = "time", repeats: int = 3) -> tuple[int, ...]:
    """A balance for ``split_size`` stages from profiling ``by`` 'time' or 'memory'."""
    profilers: dict[str, Callable[[], list]] = {
        "time": lambda: profile_layer_times(layers, sample, repeats),
        "memory": lambda: profile_layer_memory(layers, sample),
    }
    if by not in profilers:
        raise ValueError(f"auto_balance by={by!r}: use 'time' or 'memory'")
    return partition_costs(profilers[by](), split_size)
