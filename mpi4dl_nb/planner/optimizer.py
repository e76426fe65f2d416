"""What an optimizer keeps (state) and allocates for a step, found by running it on ``meta``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .live_bytes import LiveBytes

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum 0.9: the planner's assumption when no optimizer is given."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@dataclass(frozen=True)
class OptimizerFootprint:
    """Bytes for one stage's parameters: gradients, optimizer state, a step's temporaries."""

    grad_bytes: int
    state_bytes: int
    step_bytes: int


_CACHE: dict[tuple, OptimizerFootprint] = {}


def optimizer_footprint(layers: Sequence[nn.Module], dtype: torch.dtype,
                        factory: OptimizerFactory | None = None,
                        states: int | None = None) -> OptimizerFootprint:
    """Gradients, state and step temporaries of ``factory`` on ``layers``' parameters (as
    ``dtype``), from two steps on ``meta`` copies; ``states`` instead: that many
    parameter-sized state tensors and no temporaries."""
    shapes = tuple(tuple(p.shape) for layer in layers for p in layer.parameters() if p.requires_grad)
    size = torch.empty((), dtype=dtype).element_size()
    grad_bytes = sum(_numel(s) for s in shapes) * size
    if states is not None:
        return OptimizerFootprint(grad_bytes, states * grad_bytes, 0)
    key = (shapes, dtype, factory)
    found = _CACHE.get(key)
    if found is None:
        found = _simulate(shapes, dtype, factory or default_optimizer, grad_bytes)
        _CACHE[key] = found
    return found


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _simulate(shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, factory: OptimizerFactory,
              grad_bytes: int) -> OptimizerFootprint:
    if not shapes:
        return OptimizerFootprint(0, 0, 0)
    params = [nn.Parameter(torch.empty(s, dtype=dtype, device="meta")) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer = factory(params)
    live = LiveBytes()
    with live:
        optimizer.step()            # creates the state
        state = live.current
        live.reset_peak()
        optimizer.step()
        step = live.peak - state
    return OptimizerFootprint(grad_bytes, state, max(0, step))
