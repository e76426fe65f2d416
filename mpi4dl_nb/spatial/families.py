"""The one table of conversions: every family of modules spatialize converts, and the op families the guard asks."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from torch import nn

from . import dropout, interpolate, mil_pool, norm_calls, pool_calls, reductions, relayout
from .cost import FamilyCost
from .guard import OpFamilyHandlers
from .layer import Convert, SpatialRuntime
from .registry import ELEMENTWISE, GUARDED, SPATIAL_LAYERS, as_it_is, convert_torch_layer, pass_guarded
from .same_padding import convert_same_padded
from .timm_classes import TimmKind, from_timm, timm_kinds
from .tokens.attention import adopt_attention
from .tokens.traffic import attention_ring_cost
from .tokens.vit import CutPiece, convert_cut_piece, convert_token_model
from .windows.linear import adopt_linear_attention
from .windows.partition import adopt_partition_attention
from .windows.swin import convert_swin_part
from .windows.swin3d import convert_volume_swin, declares_volume_swin
from .windows.swin_trunk import SwinTrunkPiece, convert_swin_trunk
from .windows.traffic import linear_cost, partition_cost, swin_cost

# a family's conversion: (module, its full name, the model's runtime, the converter for its children) -> the module
# on tiles, or None to leave it to the next family (and then to the converter's own rules)
FamilyConvert = Callable[[nn.Module, str, SpatialRuntime, Convert], nn.Module | None]
LeafConvert = Callable[[nn.Module, SpatialRuntime, str], nn.Module | None]   # a conversion without children


@dataclass(frozen=True)
class Family:
    """One family of modules ``spatialize`` converts: ``name``; ``matches``: whether a module is of the family;
    ``convert``: what it becomes on tiles (a ConfigError naming it where it cannot be exact); ``exactness``: the
    program (a repository path) that checks it equal to one process in float64; ``cost``: its cost model for the
    planner (None: not modelled)."""

    name: str
    matches: Callable[[nn.Module], bool]
    convert: FamilyConvert
    exactness: str
    cost: FamilyCost | None = None


def leaf(make: LeafConvert) -> FamilyConvert:
    """A family conversion from ``make(module, runtime, name)``, which converts no children itself."""
    def convert(module: nn.Module, name: str, runtime: SpatialRuntime, _: Convert) -> nn.Module | None:
        return make(module, runtime, name)
    return convert


def of_types(kinds: Container[type]) -> Callable[[nn.Module], bool]:
    """Matches modules whose class is one of ``kinds`` exactly (a subclass may have its own forward)."""
    return lambda module: type(module) in kinds


def of_timm(*kinds: TimmKind) -> Callable[[nn.Module], bool]:
    """Matches timm modules of ``kinds`` (their subclasses too; timm stays unimported for other models)."""
    return lambda module: from_timm(module) and isinstance(module, timm_kinds(*kinds))


def _token_attention(module: nn.Module, runtime: SpatialRuntime, name: str) -> nn.Module:
    return adopt_attention(module, runtime, name)


# in the order they are asked: the first family that matches a module and converts it decides
FAMILIES: tuple[Family, ...] = (
    Family("Swin (timm SwinTransformer, SwinTransformerV2)",
           of_timm(TimmKind.SWIN_MODEL, TimmKind.SWIN_BLOCK, TimmKind.SWIN_MERGE, TimmKind.SWIN_CR),
           convert_swin_part, "tests/mpi/swin_exact.py", swin_cost),
    Family("Swin (a cut Swin's trunk: models/swin.py's SwinTrunk, patch embedding .. average pool)",
           lambda module: isinstance(module, SwinTrunkPiece), convert_swin_trunk,
           "tests/mpi/transformer_families_cli.py", swin_cost),
    Family("ViT attention (timm Attention, AttentionRope, EvaAttention, AttentionPoolLatent)",
           of_timm(TimmKind.VIT_ATTENTION, TimmKind.ATTENTION_POOL), leaf(_token_attention), "tests/mpi/vit_exact.py",
           attention_ring_cost),
    Family("ViT token model (timm VisionTransformer, Eva; a patch embedding outside one refused)",
           of_timm(TimmKind.VIT_MODEL, TimmKind.PATCH_EMBED, TimmKind.HYBRID_EMBED), convert_token_model,
           "tests/mpi/vit_exact.py"),
    Family("cut ViT pieces (models/vit.py's embedding and rotary block pieces)",
           lambda module: isinstance(module, CutPiece), convert_cut_piece, "tests/mpi/vit_exact.py"),
    Family("MaxViT partition attention (timm PartitionAttentionCl, PartitionAttention2d)",
           of_timm(TimmKind.PARTITION_CL, TimmKind.PARTITION_2D), adopt_partition_attention,
           "tests/mpi/attention_families_exact.py", partition_cost),
    Family("EfficientViT linear attention (timm LiteMLA)", of_timm(TimmKind.LINEAR_ATTENTION),
           adopt_linear_attention, "tests/mpi/attention_families_exact.py", linear_cost),
    Family("TF-same padded and weight-standardised layers (timm StdConv2d(Same), Conv2dSame, MaxPool2dSame)",
           of_timm(TimmKind.STD_CONV, TimmKind.CONV_SAME, TimmKind.MAX_POOL_SAME), leaf(convert_same_padded),
           "tests/mpi/vit_exact.py"),
    Family("3-D Swin (models/swin3d.py's window blocks and patch merging)", declares_volume_swin,
           leaf(convert_volume_swin), "tests/mpi/spatial3d.py"),
    Family("torch layers with a spatial version (registry.SPATIAL_LAYERS)", of_types(SPATIAL_LAYERS),
           leaf(convert_torch_layer), "tests/mpi/spatial_exactness.py"),
    Family("guarded torch layers (registry.GUARDED: dropout, LayerNorm, RMSNorm, Conv1d)", of_types(GUARDED),
           leaf(pass_guarded), "tests/mpi/spatial_families.py"),
    Family("element-wise torch layers (registry.ELEMENTWISE)", of_types(ELEMENTWISE), leaf(as_it_is),
           "tests/mpi/spatial_correctness.py"),
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
