"""A named classifier's global average pool replaced by another head pool (``--pool max|attention``), the rest kept."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .external import layer_shapes
from .pieces import Functional, Piece
from .pools import AttentionMILPool, GlobalMaxPool, PoolKind

GLOBAL_POOLS = {nn.AdaptiveAvgPool2d: "avg", nn.AdaptiveMaxPool2d: "max"}
POOL_CALLS = {"adaptive_avg_pool2d": "avg", "adaptive_max_pool2d": "max", "mean": "avg", "amax": "max"}
PROBE_SIDE = 224          # the side the trunk's feature channels are probed at (meta device: nothing computed)
NEW_PATH = "head_pool"     # where a pool replacing a functional one (DenseNet's adaptive_avg_pool2d()) goes
WHERE = ("avgpool (torchvision), global_pool.pool (timm) or adaptive_avg_pool2d() (DenseNet) as the first step of "
         "its last piece")


def _whole_image(value: object) -> bool:
    return value in (1, (1, 1), [1, 1])


def _spatial_dims(value: object) -> bool:
    dims = {value} if isinstance(value, int) else set(value) if isinstance(value, (tuple, list)) else set()
    return dims in ({2, 3}, {-2, -1})


def global_pool_kind(module: nn.Module) -> str | None:
    """``avg``/``max`` when ``module`` pools a 4-D map to one value per channel, else None."""
    kind = GLOBAL_POOLS.get(type(module))
    if kind is not None:
        return kind if _whole_image(getattr(module, "output_size", None)) else None
    if not isinstance(module, Functional):
        return None
    call = module.call
    kind = POOL_CALLS.get(call.name)
    if kind is None:
        return None
    rest = [*call.args[1:], *call.kwargs.values()]
    if call.name.startswith("adaptive"):
        return kind if rest and _whole_image(rest[0]) else None
    return kind if rest and _spatial_dims(rest[0]) else None


class PooledMap(nn.Module):
    """A pool to (N, C) given the shape of the average pool it replaces, (N, C, 1, 1): the model's own flatten,
    LayerNorm2d or Linear after it see what they saw before."""

    def __init__(self, kind: PoolKind, pool: nn.Module) -> None:
        super().__init__()
        self.kind = kind
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x)[:, :, None, None]


def replacement(kind: PoolKind, channels: int) -> nn.Module:
    """The step taking the average pool's place: a global max pool (``GlobalMaxPool``: the first
    maximum in row-major order takes the gradient) or gated attention-MIL over ``channels`` features (new
    parameters, drawn from torch's current seed)."""
    if kind is PoolKind.MAX:
        return PooledMap(kind, GlobalMaxPool())
    if kind is PoolKind.ATTENTION:
        return PooledMap(kind, AttentionMILPool(channels))
    raise ValueError(f"--pool {kind}: a named model's average pool is replaced by max or attention only")


def with_named_pool(layers: Sequence[nn.Module], kind: PoolKind, label: str, channels: int,
                    feature_channels: int | None = None) -> list[nn.Module]:
    """``layers`` (a cut named classifier) with its global average pool replaced by ``kind``; every other step and
    its weights kept. ``channels``: the input's (to probe the trunk's feature channels unless
    ``feature_channels`` gives them). ConfigError naming ``label`` and the piece expected when the pool is not
    found (ValueError for tissue-mean: ``ModelSpec.of`` refuses it for named models)."""
    kind = PoolKind(kind)
    if kind is PoolKind.AVG:
        return list(layers)
    *trunk, last = layers
    steps = last.steps() if isinstance(last, Piece) else []
    first = steps[0] if steps else None
    if first is None or global_pool_kind(first[1]) != "avg":
        found = f"{first[0]} ({type(first[1]).__name__})" if first else f"a {type(last).__name__}"
        raise ConfigError("--pool", f"--pool {kind}: cannot find the global average pool of {label} to replace: "
                                    f"expected {WHERE}, found {found}; use --pool avg, or a model whose head "
                                    f"starts with a global average pool")
    if feature_channels is None:
        feature_channels = int(layer_shapes(trunk, PROBE_SIDE, channels)[-1][1])
    path = first[0] if not first[0].endswith(")") else NEW_PATH    # a functional step's name is in no state dict
    dtype = next((p.dtype for p in last.parameters()), torch.float32)
    return [*trunk, Piece([(path, replacement(kind, feature_channels).to(dtype)), *steps[1:]])]


def fresh_keys(layers: Sequence[nn.Module]) -> set[str]:
    """The keys (of ``nn.Sequential(*layers)``) of a replaced pool's own tensors: new, in no pretrained file."""
    net = nn.Sequential(*layers)
    return {f"{name}.{key}" for name, module in net.named_modules() if isinstance(module, PooledMap)
            for key in module.state_dict()}


def replaced_pool(layers: Sequence[nn.Module]) -> PoolKind | None:
    """The pool ``with_named_pool`` put in the last piece of ``layers`` (None: the model pools as it came)."""
    last = layers[-1] if layers else None
    steps = last.steps() if isinstance(last, Piece) else []
    return steps[0][1].kind if steps and isinstance(steps[0][1], PooledMap) else None
