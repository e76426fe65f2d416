"""Layer-wise learning-rate decay (--layer-decay F, BEiT's): a transformer's rates decayed block by block, as
parameter groups whose scales come from the parameters' whole-model names, so every stage of any layout agrees.

With ``L`` blocks, layer ids are 0 for the layers before the first block (the embedding: patch embedding, class and
register tokens, position embedding), ``i + 1`` for block ``i``, and ``L + 1`` for the layers after the last block
(final norm, head); a parameter of layer id ``j`` trains at ``lr * F ** (L + 1 - j)``: the embedding at
``lr * F ** (L + 1)``, block ``i`` at ``lr * F ** (L - i)``, the head at ``lr``. ``ScaledOptimizer`` is the optimizer
factory the engine calls with this rank's parameters by whole-model name (``make_optimizer``); each group carries its
``lr_scale`` and is built at ``lr * lr_scale``, which ``LRSchedule.apply`` multiplies step by step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import ConfigError
from .optim import OptimizerSpec

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SCALE = "lr_scale"          # the parameter group's key of its scale


def layer_of(key: str) -> int:
    """The layer index of a whole-model key (``nn.Sequential(*layers)``'s: ``'3.blocks.2.attn.qkv.weight'`` -> 3)."""
    head, _, _ = key.partition(".")
    if not head.isdigit():
        raise ValueError(f"{key!r} is not a key of a layer list (<layer>.<name>)")
    return int(head)


def decay_scales(keys: Iterable[str], block_layers: Sequence[int], factor: float) -> dict[str, float]:
    """Each whole-model key's rate scale by BEiT's rule (module docstring): ``block_layers`` are the indices of the
    layers holding the blocks, in order; ConfigError for ``factor`` outside (0, 1] or no blocks."""
    if not 0.0 < factor <= 1.0:
        raise ConfigError("--layer-decay", f"must lie in (0, 1] (1: no decay), got {factor:g}")
    if not block_layers:
        raise ConfigError("--layer-decay", "decays a transformer's rates block by block; this model has no blocks: "
                                           "drop --layer-decay")
    depth = len(block_layers)
    block_id = {layer: index + 1 for index, layer in enumerate(block_layers)}
    first, last = block_layers[0], block_layers[-1]

    def layer_id(layer: int) -> int:
        if layer in block_id:
            return block_id[layer]
        return 0 if layer < first else depth + 1 if layer > last else -1

    scales = {}
    for key in keys:
        found = layer_id(layer_of(key))
        if found < 0:
            raise ConfigError("--layer-decay", f"{key} lies between the blocks in no block of its own; layer decay "
                                               f"takes a transformer whose blocks follow each other: drop "
                                               f"--layer-decay")
        scales[key] = factor ** (depth + 1 - found)
    return scales


@runtime_checkable
class NamedOptimizerFactory(Protocol):
    """An optimizer factory that takes this rank's parameters with their whole-model names."""

    def by_name(self, named: Sequence[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer: ...


class ScaledOptimizer:
    """``spec``'s optimizer with a parameter group per rate scale, the scales by whole-model name (``scales``)."""

    def __init__(self, spec: OptimizerSpec, scales: Mapping[str, float]) -> None:
        self.spec = spec
        self.scales = dict(scales)

    def groups(self, named: Sequence[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        """The parameter groups of ``named``: one per scale, the largest first, each at ``lr * scale``."""
        by_scale: dict[float, list[nn.Parameter]] = {}
        for key, param in named:
            if key not in self.scales:
                raise KeyError(f"no learning-rate scale for {key}")
            by_scale.setdefault(self.scales[key], []).append(param)
        return [{"params": params, "lr": self.spec.lr * scale, SCALE: scale}
                for scale, params in sorted(by_scale.items(), key=lambda item: -item[0])]

    def by_name(self, named: Sequence[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        return self.spec.build(self.groups(named))

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        raise TypeError("ScaledOptimizer needs the parameters' whole-model names: call by_name((key, parameter), ...)")


def make_optimizer(factory: OptimizerFactory | NamedOptimizerFactory,
                   named: Sequence[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The optimizer ``factory`` builds over ``named`` (whole-model key, parameter): by name when it takes names."""
    if isinstance(factory, NamedOptimizerFactory):
        return factory.by_name(named)
    return factory([param for _, param in named])
