"""Point-to-point payloads (a tensor or a tuple of tensors) with a small header, and a mailbox
that takes a channel's payloads in the order they were sent.

A payload travels as two messages, posted in the same order on both sides: the header
(message tag, tuple flag, dtype and shape of each tensor) on the control plane
(``Comm.exchange_host``: host memory to host memory, matched per pair in posting order), then
all its tensors in one exchange on its route. The header never touches a device, so the
receiver learns the shapes without waiting for a kernel (on a GPU, reading a header that came
through NCCL would wait for every kernel queued before it, once per received payload). The
receiver checks the header's tag against the one it expects, so a broken posting order (on
the torch plane nothing else would notice two same-shaped payloads swapped) fails loudly
instead of training on the wrong micro-batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .handles import Channel, Group, Request, Transfer

if TYPE_CHECKING:
    from .protocol import Comm

# what crosses a stage boundary: a tensor or a tuple of tensors (skip connections); lists are
# accepted where a payload is read (``as_items``, ``like``) and travel as tuples
Payload = torch.Tensor | tuple[torch.Tensor, ...]

MAX_TENSORS = 16
MAX_DIMS = 8
_FIELDS = 2 + MAX_DIMS          # per tensor: dtype code, ndim, dims
_BASE = 3                        # tag, is_tuple, count
HEADER_LEN = _BASE + MAX_TENSORS * _FIELDS
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
HOST = torch.device("cpu")      # where headers live, on every plane and device
HeaderFields = tuple[int, bool, list[tuple[torch.dtype, tuple[int, ...]]]]   # tag, tuple flag, (dtype, shape)s


def as_items(payload: Payload | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The tensors of a payload as a tuple."""
    return tuple(payload) if isinstance(payload, (tuple, list)) else (payload,)


def like(template: Payload | list[torch.Tensor], items: Sequence[torch.Tensor]) -> Payload:
    """``items`` shaped like ``template`` (tuple or single tensor)."""
    return tuple(items) if isinstance(template, (tuple, list)) else items[0]


def checked_items(payload: Payload | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``as_items(payload)``; TypeError/ValueError unless it is at most MAX_TENSORS tensors."""
    items = as_items(payload)
    if not all(isinstance(t, torch.Tensor) for t in items):
        kinds = [type(t).__name__ for t in items]
        raise TypeError(f"stage boundaries must carry tensors or tuples of tensors, got {kinds}")
    if len(items) > MAX_TENSORS:
        raise ValueError(f"a stage boundary carries {len(items)} tensors; at most {MAX_TENSORS}")
    return items


class MessageOrderError(RuntimeError):
    """A payload arrived out of the order both sides must post in (a broken ordering rule)."""


def encode_header(payload: Payload, device: torch.device, tag: int = 0) -> torch.Tensor:
    """int64 header: tag, tuple flag, tensor count, then (dtype, ndim, dims) per tensor; built on the host, on
    ``device`` when another is asked for (the payloads' headers stay on the host: ``HOST``)."""
    items = checked_items(payload)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device="cpu")   # built on the host, one copy
    header[0] = int(tag)
    header[1] = int(isinstance(payload, (tuple, list)))
    header[2] = len(items)
    for i, t in enumerate(items):
        if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
            raise ValueError(f"cannot send a {t.dim()}-d {t.dtype} tensor between stages")
        base = _BASE + i * _FIELDS
        header[base] = DTYPES.index(t.dtype)
        header[base + 1] = t.dim()
        header[base + 2:base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64, device="cpu")
    return header if device == HOST else header.to(device)


def decode_header(header: torch.Tensor) -> HeaderFields:
    """(tag, tuple flag, [(dtype, shape)] per tensor) from an ``encode_header`` header."""
    return decode_values(header.cpu().tolist())


def decode_values(values: list[int]) -> HeaderFields:
    """``decode_header`` of a header's values."""
    specs = []
    for i in range(values[2]):
        base = _BASE + i * _FIELDS
        ndim = values[base + 1]
        specs.append((DTYPES[values[base]], tuple(values[base + 2:base + 2 + ndim])))
    return int(values[0]), bool(values[1]), specs


def payload_bytes(payload: Payload) -> int:
    """Bytes of the tensors of ``payload``."""
    return sum(t.numel() * t.element_size() for t in as_items(payload))


HeaderKey = tuple[torch.device, int, bool, tuple[tuple[torch.dtype, torch.Size], ...]]


class HeaderCache:
    """Encoded headers by (device, tag, tuple flag, dtypes and shapes): a pipeline sends the same few every step.

    A cached header is never written again, so several sends may read it at once; ``limit`` bounds the
    cache (a run whose shapes keep changing, e.g. inference on ragged tiles, starts it afresh)."""

    def __init__(self, limit: int = 512) -> None:   # 512 headers of 1 KiB at most
        self.limit = limit
        self.headers: dict[HeaderKey, torch.Tensor] = {}

    def header(self, payload: Payload, items: Sequence[torch.Tensor], device: torch.device, tag: int) -> torch.Tensor:
        key = (device, tag, isinstance(payload, (tuple, list)), tuple((t.dtype, t.shape) for t in items))
        found = self.headers.get(key)
        if found is None:
            if len(self.headers) >= self.limit:
                self.headers.clear()
            found = self.headers[key] = encode_header(payload, device, tag)
        return found


HEADERS = HeaderCache()


class HeaderBuffer:
    """Host memory one header is received into: a NumPy array, and a tensor view of it for the transfer (read
    through the array: host memory by construction, so reading it never waits for a device)."""

    def __init__(self) -> None:
        self.values = np.zeros(HEADER_LEN, dtype=np.int64)
        self.tensor = torch.from_numpy(self.values)

    def decode(self) -> HeaderFields:
        return decode_values(self.values.tolist())


def isend_payload(ctx: Comm, payload: Payload, dst: int, tag: int,
                  via: Group | Channel | None = None) -> list[Request]:
    """Start sending ``payload`` to ``dst``: its header on the control plane, then its tensors on route ``via``.

    Returns the requests (wait before changing the tensors).
    """
    items = [t.detach().contiguous() for t in checked_items(payload)]
    requests = [ctx.exchange_host([Transfer.to(HEADERS.header(payload, items, HOST, tag), dst, tag)])]
    if items:
        requests.append(ctx.exchange([Transfer.to(t, dst, tag) for t in items], via))
    return requests


def recv_payload(ctx: Comm, src: int, tag: int, device: torch.device,
                 via: Group | Channel | None = None, header: HeaderBuffer | None = None) -> Payload:
    """Receive the next payload ``isend_payload`` sent from ``src`` on ``via`` onto ``device``; it must carry
    ``tag``. ``header``: the host buffer to receive the header into (reused by a caller that receives one
    payload at a time)."""
    if header is None:
        header = HeaderBuffer()
    ctx.exchange_host([Transfer.into(header.tensor, src, tag)]).wait()
    got, is_tuple, specs = header.decode()
    if got != tag:
        raise MessageOrderError(f"rank {ctx.rank} expected the payload with tag {tag} from rank {src} "
                                f"but the next one carries tag {got}: both sides must post the "
                                f"messages of a route in the same order")
    items = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
    if items:
        ctx.exchange([Transfer.into(t, src, tag) for t in items], via).wait()
    return tuple(items) if is_tuple else items[0]


class Mailbox:
    """Takes the payloads of one-way channels in the order they were sent.

    ``order[src]`` lists, in send order, the (message key, tag) of every payload ``src``
    sends to this rank in one round (a training step). ``take(src, key)`` receives from
    ``src``'s channel in that order until ``key``'s payload is in, keeping the ones that
    arrived ahead of their receive action; so the receiver posts exactly as the sender
    did, whatever order its own receive actions come in.
    """

    def __init__(self, ctx: Comm, device: torch.device,
                 order: Mapping[int, Sequence[tuple[Hashable, int]]],
                 routes: Mapping[int, Channel | None]) -> None:
        self.ctx = ctx
        self.device = device
        self.order = order
        self.routes = routes
        self._next = {src: 0 for src in order}
        self._early: dict[int, dict[Hashable, Payload]] = {src: {} for src in order}
        self.early_total = 0    # payloads that arrived ahead of their receive action, ever
        self._header = HeaderBuffer()   # one receive at a time

    def begin(self) -> None:
        """Start a round: every channel from its first message."""
        self.check_drained()
        self._next = {src: 0 for src in self.order}

    def take(self, src: int, key: Hashable) -> Payload:
        early = self._early.get(src)
        if early is None:
            raise MessageOrderError(f"rank {self.ctx.rank} receives nothing from rank {src} "
                                    f"in this schedule (asked for {key})")
        while key not in early:
            position = self._next[src]
            if position >= len(self.order[src]):
                raise MessageOrderError(f"rank {self.ctx.rank}: {key} is not among the messages "
                                        f"rank {src} sends in a round")
            expected, tag = self.order[src][position]
            self._next[src] = position + 1
            early[expected] = recv_payload(self.ctx, src, tag, self.device, self.routes.get(src), self._header)
            if expected != key:
                self.early_total += 1
        return early.pop(key)

    @property
    def held(self) -> int:
        """Payloads received ahead of their receive action and not yet taken."""
        return sum(len(early) for early in self._early.values())

    def check_drained(self) -> None:
        """MessageOrderError if payloads of the last round were never taken."""
        if self.held:
            left = {src: list(early) for src, early in self._early.items() if early}
            raise MessageOrderError(f"rank {self.ctx.rank}: payloads received but never used: {left}")
