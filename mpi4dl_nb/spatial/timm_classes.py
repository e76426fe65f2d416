"""timm's classes the conversion families match, by role, each resolved once; none where timm is not installed."""

from __future__ import annotations

import importlib
from enum import Enum
from functools import cache

from torch import nn


class TimmKind(Enum):
    """A role of timm classes in the conversion families: its value, the classes' dotted paths."""

    VIT_MODEL = ("timm.models.vision_transformer.VisionTransformer", "timm.models.eva.Eva")
    VIT_ATTENTION = ("timm.layers.attention.Attention", "timm.layers.attention.AttentionRope",
                     "timm.models.eva.EvaAttention")   # token mixing only in scaled_dot_product_attention
    ATTENTION_POOL = ("timm.layers.attention_pool.AttentionPoolLatent",)   # a learned latent query (SigLIP's MAP)
    PATCH_EMBED = ("timm.layers.PatchEmbed",)
    HYBRID_EMBED = ("timm.layers.HybridEmbed",)
    PARTITION_CL = ("timm.models.maxxvit.PartitionAttentionCl",)   # MaxViT's partition attention, channels last
    PARTITION_2D = ("timm.models.maxxvit.PartitionAttention2d",)
    LINEAR_ATTENTION = ("timm.models.efficientvit_mit.LiteMLA",)
    SWIN_MODEL = ("timm.models.swin_transformer.SwinTransformer",
                  "timm.models.swin_transformer_v2.SwinTransformerV2")
    SWIN_CR = ("timm.models.swin_transformer_v2_cr.SwinTransformerV2Cr",)   # no tile version (own stages, blocks)
    SWIN_BLOCK = ("timm.models.swin_transformer.SwinTransformerBlock",
                  "timm.models.swin_transformer_v2.SwinTransformerV2Block")
    SWIN_MERGE = ("timm.models.swin_transformer.PatchMerging", "timm.models.swin_transformer_v2.PatchMerging")
    SWIN_MERGE_V2 = ("timm.models.swin_transformer_v2.PatchMerging",)
    SWIN_STAGE = ("timm.models.swin_transformer.SwinTransformerStage",
                  "timm.models.swin_transformer_v2.SwinTransformerV2Stage")
    STD_CONV = ("timm.layers.StdConv2d", "timm.layers.StdConv2dSame")   # weight-standardised convs
    CONV_SAME = ("timm.layers.Conv2dSame",)
    MAX_POOL_SAME = ("timm.layers.pool2d_same.MaxPool2dSame",)


@cache
def timm_class(path: str) -> type[nn.Module] | None:
    """The module class at the dotted ``path`` (``"timm.layers.attention.Attention"``); None where timm, or that
    class in the installed version, is missing."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) and issubclass(found, nn.Module) else None


@cache
def timm_kind(kind: TimmKind) -> tuple[type[nn.Module], ...]:
    """The classes of ``kind`` the installed timm has (empty without timm)."""
    return tuple(cls for cls in map(timm_class, kind.value) if cls is not None)


def timm_kinds(*kinds: TimmKind) -> tuple[type[nn.Module], ...]:
    """The classes of every one of ``kinds``, in order."""
    return tuple(cls for kind in kinds for cls in timm_kind(kind))


def from_timm(module: nn.Module) -> bool:
    """Whether ``module``'s class is timm's: the timm families match only then (timm stays unimported for other
    models)."""
    return type(module).__module__.startswith("timm.")
