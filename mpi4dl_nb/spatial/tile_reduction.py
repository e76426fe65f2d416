"""Tile gradients summed while the backward runs: buckets of parameters whose all-reduce is posted, on a
communicator of its own, as soon as their gradients are accumulated (``reduce_tile_gradients`` with ``overlap``)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..comm.grad_hooks import hook_arrivals, remove_hooks
from ..comm.handles import Group, Request
from ..comm.protocol import Comm


@runtime_checkable
class PrivateGroups(Protocol):
    """A context that can put a group on a communicator of its own (``Context.private_group``)."""

    def private_group(self, group: Group | None = None) -> Group | None: ...


TILE_BUCKET_MB = 4.0    # a bucket's size: small enough that the first ones go early in backward


class _TileBucket:
    """Parameters whose gradients are summed as one flat tensor, and what their ``.grad`` were when posted."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.flat: torch.Tensor | None = None
        self.request: Request | None = None
        self.seen: list[tuple[torch.Tensor | None, int]] = []
        self.waiting: set[int] = set()

    def post(self, ctx: Comm, group: Group) -> None:
        """Post the sum of the gradients as they are now (zeros for a missing one); remember each ``.grad``."""
        with torch.no_grad():
            grads = [p.grad for p in self.params]
            self.seen = [(g, -1 if g is None else g._version) for g in grads]
            self.flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                                   for p, g in zip(self.params, grads)])
        self.request = ctx.iall_reduce(self.flat, group)

    def fresh(self) -> bool:
        """Whether every ``.grad`` is still the tensor posted, unchanged since (its version counter)."""
        return all(p.grad is g and (g is None or g._version == version)
                   for p, (g, version) in zip(self.params, self.seen))

    def write_back(self) -> None:
        """The sums become the ``.grad`` of the parameters that had one (views of the flat sum: no copy)."""
        assert self.flat is not None and self.request is not None
        self.request.wait()
        offset = 0
        for p, (g, _) in zip(self.params, self.seen):
            if g is not None:
                p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.flat = self.request = None


def _tile_buckets(params: Sequence[nn.Parameter], cap_bytes: float) -> list[_TileBucket]:
    """``params`` in reverse order (the order backward produces them) cut into buckets of at most ``cap_bytes``
    (one parameter at least), one dtype and device each."""
    buckets: list[list[nn.Parameter]] = []
    size = 0.0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        last = buckets[-1][0] if buckets else None
        if last is None or size + nbytes > cap_bytes or (last.dtype, last.device) != (p.dtype, p.device):
            buckets.append([])
            size = 0.0
        buckets[-1].append(p)
        size += nbytes
    return [_TileBucket(b) for b in buckets]


class TileReduction:
    """``reduce_tile_gradients`` overlapped with backward: buckets posted in order as their gradients arrive.

    A round runs from one ``finish`` to the next. In a round every tile posts every bucket exactly once, in
    bucket order (a bucket goes once all its parameters were accumulated after a forward of the net, or at
    ``finish``), then the tiles agree which buckets any of them saw change after posting, and post those again.
    Every member thus posts the same collectives in the same order on the round's communicator (a private copy
    of the tile group's: the blocking collectives of the backward itself, BatchNorm's or a position table's,
    never meet these), whatever backward passes ran in between or on which rank."""

    def __init__(self, ctx: Comm, group: Group, params: Sequence[nn.Parameter], net: nn.Module,
                 cap_bytes: float | None = None) -> None:
        self.ctx, self.group = ctx, group
        self.key = tuple(id(p) for p in params)
        self.buckets = _tile_buckets(params, TILE_BUCKET_MB * (1 << 20) if cap_bytes is None else cap_bytes)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.posted = 0
        self.settled = 0                # buckets before it were seen complete this round (not tested again)
        self.posted_in_backward = 0     # buckets the last round posted before ``finish`` (the overlap's share)
        self.live = False     # a forward of the net ran this round
        self._restart()
        self._hooks = hook_arrivals(self, params)
        forward = net.register_forward_pre_hook(functools.partial(_forward_seen, weakref.ref(self)))
        weakref.finalize(self, forward.remove)
        self._hooks.append(forward)

    def covers(self, params: Sequence[nn.Parameter]) -> bool:
        return tuple(id(p) for p in params) == self.key

    def _restart(self) -> None:
        self.posted, self.settled, self.live = 0, 0, False
        for bucket in self.buckets:
            bucket.waiting = {id(p) for p in bucket.params}

    def arrived(self, param: torch.Tensor) -> None:
        """A gradient of ``param`` was accumulated: post the buckets now complete, let the posted ones progress."""
        if not self.live:
            return
        self._bucket_of[id(param)].waiting.discard(id(param))
        while self.posted < len(self.buckets) and not self.buckets[self.posted].waiting:
            self.buckets[self.posted].post(self.ctx, self.group)
            self.posted += 1
        while self.settled < self.posted:      # one test of the first pending one: MPI progresses them all
            request = self.buckets[self.settled].request
            if request is not None and not request.test():
                break
            self.settled += 1

    def _post_rest(self) -> None:
        while self.posted < len(self.buckets):
            self.buckets[self.posted].post(self.ctx, self.group)
            self.posted += 1

    def finish(self) -> None:
        """Post what is left, sum again what changed since posting (on any tile), hand the sums to ``.grad``."""
        self.posted_in_backward = self.posted
        self._post_rest()
        stale = [i for i, bucket in enumerate(self.buckets) if not bucket.fresh()]
        again = sorted(set().union(*self.ctx.all_gather_object(stale, group=self.group)))
        for i in again:
            bucket = self.buckets[i]
            assert bucket.request is not None
            bucket.request.wait()
            bucket.post(self.ctx, self.group)
        for bucket in self.buckets:
            bucket.write_back()
        self._restart()

    def cancel(self) -> None:
        """Complete this round's collectives without using them, and drop the hooks."""
        self._post_rest()
        for bucket in self.buckets:
            if bucket.request is not None:
                bucket.request.wait()
            bucket.flat = bucket.request = None
        remove_hooks(self._hooks)


def _forward_seen(reduction: weakref.ref[TileReduction], module: nn.Module, args: object) -> None:
    found = reduction()
    if found is not None:
        found.live = True
