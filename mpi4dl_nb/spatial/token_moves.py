"""Moving tokens between tiles as a ``TokenMoves`` says (one exchange, every pair of tiles at most one message each
way), exactly: a permutation of the tokens, whose backward moves the gradients back along the reverse moves."""

from __future__ import annotations

from typing import Protocol

import torch

from ..comm.handles import Group, Transfer
from ..comm.protocol import Comm
from ..comm.tags import TOKEN_MOVES
from .function_ctx import FunctionContext
from .window_owners import TokenMoves


class TileRanks(Protocol):
    """What a move needs of a spatial runtime: the communicator, the tile group and every tile's rank."""

    ctx: Comm
    group: Group | None
    ranks: list[int]


def move_tokens_now(flat: torch.Tensor, moves: TokenMoves, runtime: TileRanks, tag: int) -> torch.Tensor:
    """``flat`` ``(B, size_in, C)`` moved to ``(B, size_out, C)`` (no autograd): sends and receives in one exchange,
    this tile's own tokens copied while they travel."""
    batch, channels = flat.shape[0], flat.shape[-1]
    out = flat.new_empty(batch, moves.size_out, channels)
    transfers, arrivals = [], []
    for tile, index in moves.take.items():
        if tile != moves.tile and index.numel():
            transfers.append(Transfer.to(flat[:, index.to(flat.device)].contiguous(), runtime.ranks[tile], tag))
    for tile, index in moves.put.items():
        if tile != moves.tile and index.numel():
            buffer = flat.new_empty(batch, index.numel(), channels)
            transfers.append(Transfer.into(buffer, runtime.ranks[tile], tag))
            arrivals.append((index.to(flat.device), buffer))
    request = runtime.ctx.exchange(transfers, via=runtime.group) if transfers else None
    own = moves.take.get(moves.tile)
    if own is not None and own.numel():
        out[:, moves.put[moves.tile].to(flat.device)] = flat[:, own.to(flat.device)]
    if request is not None:
        request.wait()
    for index, buffer in arrivals:
        out[:, index] = buffer
    return out


class _MoveCtx(FunctionContext, Protocol):
    moves: TokenMoves
    runtime: TileRanks


class _MoveTokens(torch.autograd.Function):
    """The move forward; backward: the gradients along the reverse moves."""

    @staticmethod
    def forward(fctx: _MoveCtx, flat: torch.Tensor, moves: TokenMoves, runtime: TileRanks) -> torch.Tensor:
        fctx.moves, fctx.runtime = moves, runtime
        return move_tokens_now(flat.detach(), moves, runtime, TOKEN_MOVES.tag(0))

    @staticmethod
    def backward(fctx: _MoveCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return move_tokens_now(grad.contiguous(), fctx.moves.reversed(), fctx.runtime, TOKEN_MOVES.tag(1)), None, None


def move_tokens(flat: torch.Tensor, moves: TokenMoves, runtime: TileRanks) -> torch.Tensor:
    """``flat`` ``(B, moves.size_in, C)`` moved to ``(B, moves.size_out, C)``, differentiable (see the module)."""
    moved: torch.Tensor = _MoveTokens.apply(flat, moves, runtime)
    return moved
