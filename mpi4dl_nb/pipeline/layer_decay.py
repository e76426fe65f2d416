"""Layer-wise learning-rate decay (--layer-decay F, BEiT's): a transformer's rates decayed block by block, as
parameter groups whose scales come from the parameters' whole-model names, so every stage of any layout agrees.

With ``L`` blocks, layer ids are 0 for the layers before the first block (the embedding: patch embedding, class and
register tokens, position embedding), ``i + 1`` for block ``i``, and ``L + 1`` for the layers after the last block
(final norm, head); a parameter of layer id ``j`` trains at ``lr * F ** (L + 1 - j)``: the embedding at
``lr * F ** (L + 1)``, block ``i`` at ``lr * F ** (L - i)``, the head at ``lr``. ``ScaledOptimizer`` is the optimizer
factory the engine calls with this rank's parameters by whole-model name (``make_optimizer``); each group carries its
``lr_scale`` and is built at ``lr * lr_scale``, which ``LRSchedule.apply`` multiplies step by step.

Each group also carries its ``name``: ``embedding``, ``block.0`` .. ``block.{L-1}`` (timm's ``blocks.i``), ``head``
(``all`` for the one group of a factor of 1, or of a plain optimizer). A LoRA run's block groups hold the block's
adapters (its weights frozen): an adapter trains at its block's rate. A rank holds the groups of its own stages only;
``gathered_groups`` collects every group's name and scale once, and a group's rate at any step is then the run's
rate times its scale (``group_rates``: metrics.jsonl's ``lr/<name>``; ``RateGroup``: the checkpoint's record).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import ConfigError
from .optim import OptimizerSpec

if TYPE_CHECKING:
    from ..comm.protocol import Comm

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SCALE = "lr_scale"          # the parameter group's key of its scale
NAME = "name"               # the parameter group's key of its name (embedding, block.3, head; all)
EVERY = "all"               # the name of the one group of a plain optimizer (or of a factor of 1)
LR_KEY = "lr/"              # metrics.jsonl's key of a group's rate: lr/embedding, lr/block.3, lr/head
GroupScale = tuple[str, float]     # a parameter group's (name, scale)


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


def group_names(scales: Mapping[str, float]) -> dict[float, str]:
    """Each distinct scale's group name. BEiT's rule with a factor below 1 gives the embedding the smallest scale,
    every block one of its own, in order, and the head (the layers after the blocks) 1: ascending, they are
    ``embedding``, ``block.0`` .. ``block.{L-1}``, ``head`` (a cut ViT holds parameters before and after its
    blocks); one scale is ``all``."""
    ordered = sorted(set(scales.values()))
    if len(ordered) <= 1:
        return {scale: EVERY for scale in ordered}
    names = {scale: f"block.{index}" for index, scale in enumerate(ordered[1:-1])}
    return {ordered[0]: "embedding", **names, ordered[-1]: "head"}


@dataclass(frozen=True)
class RateGroup:
    """A parameter group as a checkpoint records it: its ``name``, ``lr_scale`` (its rate over the run's) and ``lr``
    (its rate in the last step before the checkpoint)."""

    name: str
    lr_scale: float
    lr: float

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "lr_scale": self.lr_scale, "lr": self.lr}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> RateGroup:
        """The group ``to_dict`` wrote; ValueError naming a bad field."""
        name, scale, lr = data.get("name"), data.get("lr_scale"), data.get("lr")
        if (isinstance(name, str) and isinstance(scale, (int, float)) and isinstance(lr, (int, float))
                and not isinstance(scale, bool) and not isinstance(lr, bool)):
            return cls(name, float(scale), float(lr))
        raise ValueError(f"field 'param_groups': expected a name, lr_scale and lr, got {dict(data)!r}")


def local_groups(optimizer: torch.optim.Optimizer | None) -> list[GroupScale]:
    """This rank's parameter groups as (name, scale): ``all`` at 1 for a group without a name or scale."""
    if optimizer is None:
        return []
    return [(str(group.get(NAME, EVERY)), float(group.get(SCALE, 1.0))) for group in optimizer.param_groups]


def gathered_groups(optimizer: torch.optim.Optimizer | None, ctx: Comm) -> list[GroupScale]:
    """Every rank's parameter groups, each name once, by ascending scale (collective: on rank 0; [] elsewhere)."""
    found = ctx.gather_object(local_groups(optimizer), root=0)
    if found is None:
        return []
    merged = {name: scale for groups in found for name, scale in groups}
    return sorted(merged.items(), key=lambda item: (item[1], item[0]))


def group_rates(groups: Sequence[GroupScale], lr: float | None) -> dict[str, float]:
    """metrics.jsonl's rate of every named group at the run's rate ``lr``: ``{'lr/block.3': lr * scale, ...}`` (none
    without ``lr``, or for a plain optimizer's one unnamed group)."""
    if lr is None or [name for name, _ in groups] in ([], [EVERY]):
        return {}
    return {f"{LR_KEY}{name}": lr * scale for name, scale in groups}


def rate_records(groups: Sequence[GroupScale], lr: float | None) -> tuple[RateGroup, ...]:
    """The checkpoint's record of every parameter group at the run's rate ``lr`` (none without it)."""
    return () if lr is None else tuple(RateGroup(name, scale, lr * scale) for name, scale in groups)


@runtime_checkable
class NamedOptimizerFactory(Protocol):
    """An optimizer factory that takes this rank's parameters with their whole-model names."""

    def by_name(self, named: Sequence[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer: ...


class ScaledOptimizer:
    """``spec``'s optimizer with a parameter group per rate scale, the scales by whole-model name (``scales``)."""

    def __init__(self, spec: OptimizerSpec, scales: Mapping[str, float]) -> None:
        self.spec = spec
        self.scales = dict(scales)
        self.names = group_names(self.scales)

    def groups(self, named: Sequence[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        """The parameter groups of ``named``: one per scale, the largest first, each at ``lr * scale`` with its
        ``name`` (``group_names``)."""
        by_scale: dict[float, list[nn.Parameter]] = {}
        for key, param in named:
            if key not in self.scales:
                raise KeyError(f"no learning-rate scale for {key}")
            by_scale.setdefault(self.scales[key], []).append(param)
        return [{"params": params, "lr": self.spec.lr * scale, SCALE: scale, NAME: self.names[scale]}
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
