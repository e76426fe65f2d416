"""Point-to-point payloads (a tensor or a tuple of tensors) with a small shape header."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .handles import Request

if TYPE_CHECKING:
    from .protocol import Comm

Payload = Any   # a tensor or a tuple (or list) of tensors: what crosses a stage boundary

MAX_TENSORS = 16
MAX_DIMS = 8
_FIELDS = 2 + MAX_DIMS          # per tensor: dtype code, ndim, dims
HEADER_LEN = 2 + MAX_TENSORS * _FIELDS   # is_tuple, count, tensors...
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def as_items(payload: Payload) -> tuple[Any, ...]:
    """The tensors of a payload as a tuple."""
    return tuple(payload) if isinstance(payload, (tuple, list)) else (payload,)


def like(template: Payload, items: Sequence[Any]) -> Payload:
    """``items`` shaped like ``template`` (tuple or single tensor)."""
    return tuple(items) if isinstance(template, (tuple, list)) else items[0]


def checked_items(payload: Payload) -> tuple[torch.Tensor, ...]:
    """``as_items(payload)``; TypeError/ValueError unless it is at most MAX_TENSORS tensors."""
    items = as_items(payload)
    if not all(isinstance(t, torch.Tensor) for t in items):
        kinds = [type(t).__name__ for t in items]
        raise TypeError(f"stage boundaries must carry tensors or tuples of tensors, got {kinds}")
    if len(items) > MAX_TENSORS:
        raise ValueError(f"a stage boundary carries {len(items)} tensors; at most {MAX_TENSORS}")
    return items


def encode_header(payload: Payload, device: torch.device) -> torch.Tensor:
    """int64 header: tuple flag, tensor count, then (dtype, ndim, dims) per tensor."""
    items = checked_items(payload)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = int(isinstance(payload, (tuple, list)))
    header[1] = len(items)
    for i, t in enumerate(items):
        if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
            raise ValueError(f"cannot send a {t.dim()}-d {t.dtype} tensor between stages")
        base = 2 + i * _FIELDS
        header[base] = DTYPES.index(t.dtype)
        header[base + 1] = t.dim()
        header[base + 2:base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> tuple[bool, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """(tuple flag, [(dtype, shape)] per tensor) from an ``encode_header`` header."""
    values = header.cpu().tolist()
    specs = []
    for i in range(values[1]):
        base = 2 + i * _FIELDS
        ndim = values[base + 1]
        specs.append((DTYPES[values[base]], tuple(values[base + 2:base + 2 + ndim])))
    return bool(values[0]), specs


def payload_bytes(payload: Payload) -> int:
    """Bytes of the tensors of ``payload``."""
    return sum(t.numel() * t.element_size() for t in checked_items(payload))


def isend_payload(ctx: Comm, payload: Payload, dst: int, tag: int) -> list[Request]:
    """Start sending ``payload`` to ``dst``; returns the requests (wait before reuse)."""
    items = [t.detach().contiguous() for t in checked_items(payload)]
    device = items[0].device if items else ctx.device
    requests = [ctx.isend(encode_header(payload, device), dst, tag)]
    requests += [ctx.isend(t, dst, tag) for t in items]
    return requests


def recv_payload(ctx: Comm, src: int, tag: int, device: torch.device) -> Payload:
    """Receive a payload sent by ``isend_payload`` (same tag) from ``src``."""
    header = ctx.recv(torch.zeros(HEADER_LEN, dtype=torch.int64, device=device), src, tag)
    is_tuple, specs = decode_header(header)
    items = [ctx.recv(torch.empty(shape, dtype=dtype, device=device), src, tag)
             for dtype, shape in specs]
    return tuple(items) if is_tuple else items[0]

