"""The one list of conversions: the family records spatialize asks, in order, and the op families the guard asks."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from . import dropout, interpolate, mil_pool, norm_calls, pool_calls, reductions, relayout
from .family import Family
from .guard import OpFamilyHandlers
from .registry import ELEMENTWISE_LAYERS, GUARDED_LAYERS, TORCH_LAYERS
from .same_padding import SAME_CONVS, SAME_MAX_POOLS, STD_CONVS
from .tokens import attention, vit
from .windows import linear, partition, swin, swin3d, swin_trunk

# in the order they are asked: the first family that matches a module and converts it decides. Each module declares
# its records (``family.Family``); this list only names them, and nothing registers by being imported.
FAMILIES: tuple[Family, ...] = (
    swin.SWIN_V2_CR, swin.SWIN, swin.SWIN_BLOCK_ALONE, swin.SWIN_MERGE_ALONE, swin_trunk.SWIN_CUT_EMBEDDING,
    swin_trunk.SWIN_CUT_STAGE, swin_trunk.SWIN_CUT_HEAD,
    attention.VIT_ATTENTION, attention.VIT_ATTENTION_POOL, vit.VIT_MODEL, vit.LONE_EMBEDDING,
    vit.CUT_EMBEDDING, vit.CUT_ROPE_BLOCK,
    partition.PARTITION_ATTENTION_CL, partition.PARTITION_ATTENTION_2D, linear.LINEAR_ATTENTION,
    STD_CONVS, SAME_CONVS, SAME_MAX_POOLS, swin3d.VOLUME_WINDOW_BLOCK, swin3d.VOLUME_PATCH_MERGE,
    TORCH_LAYERS, GUARDED_LAYERS, ELEMENTWISE_LAYERS,
)

# the op families whose handlers the guard asks, each kind's in this order
OP_FAMILIES: tuple[OpFamilyHandlers, ...] = (
    dropout.OP_FAMILY, interpolate.OP_FAMILY, norm_calls.OP_FAMILY, reductions.OP_FAMILY, pool_calls.OP_FAMILY,
    relayout.OP_FAMILY, mil_pool.OP_FAMILY,
)

_ADDED: list[Family] = []


def add_family(family: Family) -> None:
    """Run-time addition: ``family`` is asked before the table's entries by every later ``spatialize`` (called
    directly or by the engine) until ``remove_family``. ``spatialize(..., families=...)`` takes a table for one call."""
    if family not in _ADDED:
        _ADDED.append(family)


def remove_family(family: Family) -> None:
    """Undo ``add_family``."""
    if family in _ADDED:
        _ADDED.remove(family)


def active_families() -> tuple[Family, ...]:
    """What ``spatialize`` asks by default: the run-time additions, then ``FAMILIES``."""
    return (*_ADDED, *FAMILIES)


def family_of(module: nn.Module, families: Sequence[Family] | None = None) -> Family | None:
    """The first family of ``families`` (default ``active_families()``) matching ``module``: what converts it, and
    its ``cost`` for the planner; None where none matches (a container or custom module, kept under the guard)."""
    for family in active_families() if families is None else families:
        if family.matches(module):
            return family
    return None
