"""Gradient buckets summed over a stage's holders during backward, each posted once its last gradient arrived.

A stage's parameters (this rank's copies of the stage side by side: a GEMS mirror held on the
same rank adds its own parameters to the same slot) are cut into buckets of about
``grad_bucket_mb`` MB in reverse registration order (the order backward produces them, as
DDP's buckets). A hook on each parameter (``register_post_accumulate_grad_hook``) counts
gradient *arrivals*: a bucket is complete once every parameter of every copy got as many
gradients as its copy runs backward passes this step (``begin_step``; with a split backward,
the passes that produce weight gradients). Complete buckets are posted as non-blocking
all-reduces strictly in bucket order (so every holder posts them in the same order), and
``finish`` posts the rest, waits and writes the sums into every copy's ``.grad`` - what
``dataparallel.sum_stage_gradients`` does in one piece. A parameter no backward reached
(unused this step) simply keeps its bucket until ``finish``; a gradient arriving after its
bucket was posted is refused (it would be missing from the sum). After the first step the buckets
are cut again in the order the gradients completed (``StageBuckets``). docs/engine.md, "Gradient
all-reduce overlapped with backward".
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm.handles import Group, Request
from ..comm.protocol import Comm
from .actions import Action, ActionKind

MB = 1 << 20

# Actions in which weight gradients arrive: the backward ``B`` and, once the schedules split the backward, its
# weight-gradient action ``W`` (by value, so that the kind counts the day it exists; ``I`` brings none).
WEIGHT_GRADIENT_KINDS: tuple[ActionKind, ...] = tuple(kind for kind in ActionKind if kind.value in ("B", "W"))


@dataclass
class _Slot:
    """One parameter of the stage: its object on each copy."""

    index: int
    params: tuple[nn.Parameter, ...]

    @property
    def numel(self) -> int:
        return self.params[0].numel()


@dataclass
class Bucket:
    """Consecutive slots reduced as one flat tensor (``deferred``: posted by ``finish`` only)."""

    index: int
    slots: list[_Slot]
    deferred: bool = False
    arrivals_left: int = 0
    flat: torch.Tensor | None = None
    request: Request | None = None

    @property
    def nbytes(self) -> int:
        first = self.slots[0].params[0]
        return sum(s.numel for s in self.slots) * first.element_size()

    def contribution(self, silent: Sequence[Collection[int]]) -> torch.Tensor:
        """This rank's sum of its copies' gradients, flat (zeros for a missing gradient, or a silent one:
        ``silent[i]`` holds the ids of copy ``i``'s parameters it does not contribute). Copies are added
        in copy order, as ``dataparallel.sum_stage_gradients`` does; one copy's gradient goes in as is."""
        pieces = []
        for slot in self.slots:
            grads = [param.grad.reshape(-1) for param, quiet in zip(slot.params, silent)
                     if id(param) not in quiet and param.grad is not None]
            if not grads:
                pieces.append(torch.zeros_like(slot.params[0]).reshape(-1))
                continue
            total = grads[0]
            for grad in grads[1:]:
                total = total + grad
            pieces.append(total)
        return torch.cat(pieces)

    def write_back(self) -> None:
        """Every copy's ``.grad``: the bucket's reduced sum."""
        assert self.flat is not None
        offset = 0
        for slot in self.slots:
            for param in slot.params:
                part = self.flat[offset:offset + slot.numel].view_as(param)
                if param.grad is None:
                    param.grad = part.clone()
                else:
                    param.grad.copy_(part)
            offset += slot.numel


def make_buckets(slots: Sequence[_Slot], cap_bytes: float, first: int = 0, deferred: bool = False) -> list[Bucket]:
    """``slots`` (in reduction order) cut into buckets of at most ``cap_bytes`` (one slot at least), one
    dtype each, numbered from ``first``."""
    buckets: list[Bucket] = []
    current: list[_Slot] = []
    size = 0
    for slot in slots:
        param = slot.params[0]
        nbytes = param.numel() * param.element_size()
        if current and (size + nbytes > cap_bytes or current[0].params[0].dtype != param.dtype):
            buckets.append(Bucket(first + len(buckets), current, deferred))
            current, size = [], 0
        current.append(slot)
        size += nbytes
    if current:
        buckets.append(Bucket(first + len(buckets), current, deferred))
    return buckets


@dataclass
class StageBuckets:
    """One stage's buckets on this rank, reduced over ``group`` (every holder of the stage).

    The first step's buckets follow reverse registration order; at its end the buckets are cut
    again in the order the gradients actually completed (rank ``group.ranks[0]``'s order, so
    every holder has the same buckets), and parameters that got no gradient go to a deferred
    last bucket (unused layers, e.g. a branch the head never reads), as DDP rebuilds its buckets.
    """

    ctx: Comm
    stage: int
    group: Group
    slots: list[_Slot]
    cap_bytes: float
    copies: int
    silent: Callable[[], Sequence[Collection[int]]]   # per copy, asked at each post (spatial layers learn
    # in forward which parameters ran on replicated tensors)
    buckets: list[Bucket] = field(init=False)
    passes: list[int] = field(default_factory=list)   # backward passes of each copy this step
    posted: int = 0   # buckets posted so far this step (always a prefix)
    active: bool = False
    counting: bool = False   # passes were counted: buckets may be posted during backward
    learned: bool = False
    _slot_of: dict[int, int] = field(default_factory=dict)   # param id -> slot index
    _bucket_of: dict[int, Bucket] = field(default_factory=dict)   # slot index -> bucket
    _last_arrival: dict[int, int] = field(default_factory=dict)   # slot index -> arrival number
    _arrivals: int = 0

    def __post_init__(self) -> None:
        self._slot_of = {id(p): slot.index for slot in self.slots for p in slot.params}
        self._use(make_buckets(self.slots, self.cap_bytes))

    def _use(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self._bucket_of = {slot.index: bucket for bucket in buckets for slot in bucket.slots}

    def begin_step(self, passes: Sequence[int]) -> None:
        """A training step starts: copy ``i`` of the stage runs ``passes[i]`` weight-gradient passes (none
        counted, e.g. a schedule whose weight-gradient action is not in WEIGHT_GRADIENT_KINDS: every bucket
        waits for ``finish``, the result is the same)."""
        self.passes = list(passes)
        self.posted = 0
        self.active = True
        self.counting = sum(self.passes) > 0
        self._arrivals = 0
        self._last_arrival.clear()
        for bucket in self.buckets:
            bucket.arrivals_left = len(bucket.slots) * sum(self.passes)   # every copy's passes, per slot
            bucket.flat = bucket.request = None

    def arrived(self, param: torch.Tensor) -> None:
        """One gradient of ``param`` was accumulated (the parameter hook; a manual weight-gradient pass
        that writes ``.grad`` itself calls it too)."""
        if not self.active:
            return
        slot = self._slot_of[id(param)]
        self._arrivals += 1
        self._last_arrival[slot] = self._arrivals
        bucket = self._bucket_of[slot]
        if bucket.deferred or not self.counting:
            return
        if bucket.index < self.posted:
            raise RuntimeError(f"stage {self.stage}: a gradient of a parameter of bucket {bucket.index} arrived "
                               f"after the bucket's all-reduce was posted (more backward passes than the "
                               f"schedule's {self.passes}); set grad_bucket_mb=None to reduce after all "
                               f"backwards")
        bucket.arrivals_left -= 1
        self._post_ready()
        self._progress()

    def _post_ready(self) -> None:
        while self.posted < len(self.buckets):
            bucket = self.buckets[self.posted]
            if bucket.deferred or bucket.arrivals_left > 0:
                return
            self._post(bucket)

    def _post(self, bucket: Bucket) -> None:
        tracer = self.ctx.tracer
        now = tracer.now()
        bucket.flat = bucket.contribution(self.silent())
        bucket.request = self.ctx.iall_reduce(bucket.flat, self.group)
        self.posted += 1
        tracer.record("allreduce-post", now, tracer.now(), stage=self.stage, bytes=bucket.nbytes,
                      bucket=bucket.index, during_backward=int(self.active))

    def _progress(self) -> None:
        """Let the posted reductions advance (MPI progresses only inside MPI calls)."""
        for bucket in self.buckets[:self.posted]:
            if bucket.request is not None:
                bucket.request.test()

    def finish(self) -> int:
        """Post the buckets still open, wait for all, write the sums into every copy; bytes reduced."""
        self.active = False
        while self.posted < len(self.buckets):
            self._post(self.buckets[self.posted])
        with self.ctx.tracer.span("allreduce-wait", stage=self.stage) as extra:
            moved = 0
            for bucket in self.buckets:
                assert bucket.request is not None
                bucket.request.wait()
                bucket.write_back()
                moved += bucket.nbytes
                bucket.flat = bucket.request = None
            extra["bytes"] = moved
        if not self.learned:
            self._relearn()
        return moved

    def _relearn(self) -> None:
        """Cut the buckets again in the order this step's gradients completed (see the class docstring)."""
        self.learned = True
        order = sorted(self._last_arrival, key=self._last_arrival.__getitem__)
        unused = [slot.index for slot in self.slots if slot.index not in self._last_arrival]
        order, unused = self.ctx.bcast_object((order, unused), root=self.group.ranks[0], group=self.group)
        buckets = make_buckets([self.slots[i] for i in order], self.cap_bytes)
        self._use(buckets + make_buckets([self.slots[i] for i in unused], self.cap_bytes, len(buckets), True))


class GradientReducer:
    """The stages' buckets of this rank and the hooks that feed them."""

    def __init__(self, ctx: Comm, cap_bytes: float) -> None:
        self.ctx = ctx
        self.cap_bytes = cap_bytes
        self.stages: dict[int, StageBuckets] = {}
        self._hooks: list[RemovableHandle] = []

    def add_stage(self, stage: int, copies: Sequence[nn.Module], group: Group,
                  silent: Callable[[], Sequence[Collection[int]]] | None = None) -> None:
        """Bucket ``copies`` (this rank's copies of ``stage``, parameters aligned) and hook their parameters.
        ``silent()[i]``: ids of copy ``i``'s parameters whose gradient it does not contribute (now)."""
        per_copy = [[p for p in m.parameters() if p.requires_grad] for m in copies]
        nothing: list[Collection[int]] = [()] * len(copies)
        slots = [_Slot(index, tuple(params)) for index, params in enumerate(reversed(list(zip(*per_copy))))]
        if not slots:   # reversed: backward produces the last layers' gradients first
            return
        buckets = StageBuckets(self.ctx, stage, group, slots, self.cap_bytes, len(copies),
                               silent if silent is not None else lambda: nothing)
        self.stages[stage] = buckets
        for slot in slots:
            for param in slot.params:
                self._hooks.append(param.register_post_accumulate_grad_hook(_arrival(buckets)))

    def begin_step(self, passes: Mapping[int, Sequence[int]]) -> None:
        """A step starts: ``passes[stage][copy]`` weight-gradient passes of each copy of each stage."""
        for stage, buckets in self.stages.items():
            buckets.begin_step(passes.get(stage, [0] * buckets.copies))

    def covers(self, stage: int) -> bool:
        return stage in self.stages

    def finish(self, stage: int) -> int:
        return self.stages[stage].finish()

    def remove(self) -> None:
        """Drop the parameter hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _arrival(buckets: StageBuckets) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        buckets.arrived(param)
    return hook


def weight_gradient_passes(actions: Sequence[Action], replica: int, stage: int, merged_copies: int = 1) -> int:
    """How many passes of ``actions`` produce weight gradients for copy (``replica``, ``stage``);
    ``merged_copies``: copies whose chunks one pass runs together (sync_batchnorm on a spatial stage)."""
    count = sum(1 for a in actions if a.kind in WEIGHT_GRADIENT_KINDS and a.replica == replica and a.stage == stage)
    return count // merged_copies
