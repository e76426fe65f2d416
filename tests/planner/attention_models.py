"""Small timm attention models for the planner's tests, as ``--model`` callables (``package.module:callable``)."""

from __future__ import annotations

from torch import nn

SWIN = "swin_tiny_patch4_window7_224"     # 224 px: 56x56 patch tokens, windows of 7
MAXVIT = "maxvit_pico_rw_256"            # the smallest _rw_ MaxViT with a position bias (rmlp: dropout): 256 px


def tiny_swin(num_classes: int = 10) -> list[nn.Module]:
    """Swin-T's geometry with one narrow block a stage, as a one-layer list: the whole model (timm's Swin has a tile
    version only whole: ``spatial/windows/swin.py``)."""
    import timm

    return [timm.create_model(SWIN, num_classes=num_classes, depths=(1, 1, 1, 1), embed_dim=32,
                              num_heads=(1, 2, 4, 8))]
