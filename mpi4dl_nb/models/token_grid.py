"""A ViT trunk's patch tokens as the slide's feature map: its head piece replaced by the final norm, the token grid and
a ``ClassifierHead`` (``--pool max|attention``, ``--slide-encoder transformer`` over a timm ViT).

A cut ViT (``models/vit.py``) ends in a ``TokenHead`` (final norm, the model's token pool, classifier). With a head
pool of the whole-slide kind or a slide encoder, that piece becomes a ``TokenGridHead``: the model's final norm (the
tokens as timm's ``forward_features`` returns them), ``PatchTokenMap`` (the patch tokens, row-major, as a (N, C, H', W')
map; the class and register tokens dropped: the slide encoder brings its own class token, as TransMIL and TITAN put a
learned class token before the patch features, and DINOv2's registers are discarded at the output), and the
classifier head the CNN trunks use (``models/head.py``: optional slide encoder, the pool, linear). It is still the
ViT's head piece (a ``TokenHead``): kept off the spatial stage, trained under ``--train-blocks``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .head import ClassifierHead
from .pools import PoolKind
from .slide_encoder import SlideEncoderSpec
from .vit import TokenEmbedding, TokenHead, is_cut_vit, patch_grid_of

GRID_STEP = "token_grid"      # the new steps' paths: in no file of the original model's weights
HEAD_STEP = "grid_head"


class PatchTokenMap(nn.Module):
    """(N, prefix + rows * cols, C) -> (N, C, rows, cols): a ViT's patch tokens as a map, its ``prefix`` class and
    register tokens dropped."""

    def __init__(self, prefix: int, grid: tuple[int, int]) -> None:
        super().__init__()
        self.prefix, self.grid = prefix, grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = self.grid
        if x.dim() != 3 or x.shape[1] != self.prefix + rows * cols:
            raise ValueError(f"the ViT's token grid is {rows}x{cols} with {self.prefix} prefix tokens "
                             f"({self.prefix + rows * cols} tokens); given {tuple(x.shape)}")
        return x[:, self.prefix:].transpose(1, 2).reshape(x.shape[0], x.shape[2], rows, cols)

    def extra_repr(self) -> str:
        return f"{self.grid[0]}x{self.grid[1]} patch tokens, {self.prefix} prefix tokens dropped"


class TokenGridHead(TokenHead):
    """A cut ViT's head piece with the model's pool and classifier replaced: its final norm, ``PatchTokenMap`` and a
    ``ClassifierHead`` over the grid."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for path in self.paths:      # looked up by path, as any piece's steps
            x = self.get_submodule(path)(x)
        return x

    @property
    def classifier(self) -> ClassifierHead:
        head = self.get_submodule(HEAD_STEP)
        assert isinstance(head, ClassifierHead)
        return head


def with_token_grid(layers: Sequence[nn.Module], pool: PoolKind, encoder: SlideEncoderSpec | None,
                    label: str) -> list[nn.Module]:
    """``layers`` (a cut ViT) with its head piece a ``TokenGridHead`` pooling as ``pool`` after ``encoder`` (if
    any): its blocks and final norm kept, the pool and classifier new (drawn from torch's current seed). ConfigError
    naming ``label`` for tissue-mean (a ViT does not carry the tissue mask) and a width the encoder cannot take."""
    kind = PoolKind(pool)
    if kind.tissue:
        raise ConfigError("--pool", f"--pool tissue-mean needs the tissue mask carried through the trunk, which "
                                    f"{label}'s blocks do not; use --pool attention or max")
    assert is_cut_vit(layers), "with_token_grid takes a ViT cut by models/vit.token_pieces"
    *trunk, last = layers
    embedding = layers[0]
    assert isinstance(embedding, TokenEmbedding) and isinstance(last, TokenHead)
    norm = dict(last.steps()).get("norm", nn.Identity())
    classes, channels = classes_and_width(last, label)
    prefix = embedding.settings.get("num_prefix_tokens", 0)
    grid = PatchTokenMap(prefix if isinstance(prefix, int) else 0, patch_grid_of(embedding))
    if encoder is not None:
        encoder.check_width(channels)
    dtype = next((p.dtype for p in last.parameters()), torch.float32)
    head = ClassifierHead(channels, classes, pool=kind, encoder=encoder).to(dtype)
    return [*trunk, TokenGridHead([("norm", norm), (GRID_STEP, grid), (HEAD_STEP, head)], last.source,
                                  last.settings, 1)]


def classes_and_width(head: TokenHead, label: str) -> tuple[int, int]:
    """(classes, token width) of a ViT's head piece (the model's ``num_classes`` and ``embed_dim``)."""
    classes, width = head.settings.get("num_classes"), head.settings.get("embed_dim")
    if not isinstance(classes, int) or not isinstance(width, int) or classes < 1:
        raise ConfigError("--pool", f"{label} has no classifier for a number of classes (num_classes "
                                    f"{classes!r}, embed_dim {width!r}); build it with num_classes > 0")
    return classes, width


REPLACED = ("fc_norm.", "attn_pool.", "head.")   # the keys of the model's own pool and classifier the new head replaces


def grid_head_keys(layers: Sequence[nn.Module]) -> tuple[set[str], tuple[str, ...]]:
    """For pretrained weights (``models/weights.py``): the engine keys of a ``TokenGridHead``'s new classifier head
    (in no file of the model: kept as drawn) and the prefixes of the file's keys it replaces (the model's pool and
    classifier: not loaded); nothing without such a head."""
    if not layers or not isinstance(layers[-1], TokenGridHead):
        return set(), ()
    index = len(layers) - 1
    return {f"{index}.{HEAD_STEP}.{key}" for key in layers[-1].classifier.state_dict()}, REPLACED
