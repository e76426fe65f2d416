"""Pools of a ViT's token tiles to one replicated vector per image: the class token, the mean of the image tokens."""

from __future__ import annotations

from typing import Protocol

import torch

from ..comm.handles import Group
from ..comm.protocol import Comm
from .function_ctx import FunctionContext
from .reduce import replicated_sum
from .tokens import TokenTiles


class _OwnedTokenCtx(FunctionContext, Protocol):
    shape: tuple[int, ...]
    owner: bool


class _OwnedToken(torch.autograd.Function):
    """Token 0 of the owner's tokens on every rank (bitwise: the others add zeros); backward: the owner's only
    (every rank holds the same full gradient of a replicated result), zeros elsewhere (keeping their graph)."""

    @staticmethod
    def forward(fctx: _OwnedTokenCtx, tokens: torch.Tensor, owner: bool, comm: Comm,
                group: Group | None) -> torch.Tensor:
        fctx.shape, fctx.owner = tuple(tokens.shape), owner
        first = tokens[:, 0].clone() if owner else tokens.new_zeros((tokens.shape[0], tokens.shape[-1]))
        return comm.all_reduce(first.contiguous(), group=group)

    @staticmethod
    def backward(fctx: _OwnedTokenCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.new_zeros(fctx.shape)
        if fctx.owner:
            out[:, 0] = grad
        return out, None, None, None


def class_token(tokens: torch.Tensor, tiles: TokenTiles, comm: Comm, group: Group | None) -> torch.Tensor:
    """``x[:, 0]`` of the whole sequence (tile 0's first token), replicated on every rank: timm's 'token' pool."""
    if tiles.grid.num_tiles == 1:
        return tokens[:, 0]
    return _OwnedToken.apply(tokens, tiles.prefix_here > 0, comm, group)


def mean_of_tokens(tokens: torch.Tensor, tiles: TokenTiles, comm: Comm, group: Group | None,
                   include_prefix: bool = False) -> torch.Tensor:
    """The mean over the image tokens (and the prefix tokens when ``include_prefix``) of the whole sequence,
    replicated on every rank: timm's 'avg' pool."""
    skip = 0 if include_prefix else tiles.prefix_here
    count = tiles.image_tokens + (tiles.num_prefix if include_prefix else 0)
    local = tokens[:, skip:].sum(dim=1)
    total = local if tiles.grid.num_tiles == 1 else replicated_sum(local, comm, group)
    return total / count
