"""Zero-bubble ZB-V order of one pipeline position over its two chunks, down the pipeline and back up (pure).

Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6: ``2P`` stages on ``P`` positions, position
``r`` holding stage ``r`` (the way down) and stage ``2P - 1 - r`` (the way back up), so the forward turns
on the last position and ends - the loss - on position 0, where the backward starts at once. Each
backward is split as in ZB-H1 (``zero_bubble.py``): ``I`` (the stage input's gradient, sent on) and ``W``
(the parameter gradients, nobody waits for them). Phases of position ``r``:

* warm-up: ``2 (P - r) - 1`` forwards down; ``r`` pairs (forward up, forward down); ``P - r`` rounds
  (forward up, ``I`` up, ``W`` up);
* steady: rounds (forward down, ``I`` down, ``W`` down, forward up, ``I`` up, ``W`` up) until every
  forward ran;
* cool-down: ``r`` pairs (``I`` down, ``I`` up), ``P - r`` pairs (``I`` down, ``W`` down), then the
  ``W`` s still owed, the up chunk's first.

Every position holds at most ``2P`` chunk activations (from a forward to its ``W``): ``P`` stages'
worth at half a stage each, 1F1B's first stage's peak on every position (balanced memory, unlike
ZB-H1 whose later stages hold more). With ``F = I = W`` no position idles in the steady phase.
With fewer micro-batches than the phases need, an op with no micro-batch left is dropped and the
ops owed are run at the end (``I`` s first); every order keeps a chunk's ``F``, ``I``, ``W`` in turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .zero_bubble import ZeroBubbleOp


class ChunkStep(NamedTuple):
    """One op of a position: ``op`` (F, I or W) of ``stage`` on ``micro_batch``."""

    op: ZeroBubbleOp
    stage: int
    micro_batch: int


@dataclass
class _VOrder:
    """The order being built: the next micro-batch of each (op, stage), ops dropped past the last."""

    micro_batches: int
    steps: list[ChunkStep] = field(default_factory=list)
    done: dict[tuple[ZeroBubbleOp, int], int] = field(default_factory=dict)

    def count(self, op: ZeroBubbleOp, stage: int) -> int:
        return self.done.get((op, stage), 0)

    def run(self, op: ZeroBubbleOp, stage: int) -> None:
        """Append ``stage``'s next ``op`` if its micro-batch exists and its previous part ran (F before I
        before W)."""
        before = {ZeroBubbleOp.INPUT: ZeroBubbleOp.FORWARD, ZeroBubbleOp.WEIGHT: ZeroBubbleOp.INPUT}.get(op)
        limit = self.micro_batches if before is None else self.count(before, stage)
        index = self.count(op, stage)
        if index < limit:
            self.steps.append(ChunkStep(op, stage, index))
            self.done[(op, stage)] = index + 1

    def owed(self, op: ZeroBubbleOp, stage: int) -> int:
        return self.micro_batches - self.count(op, stage)


def zbv_order(position: int, positions: int, micro_batches: int) -> list[ChunkStep]:
    """The ZB-V order of ``position`` (of ``positions``) over ``micro_batches`` (module docstring).

    >>> for r in range(2):
    ...     print(" ".join(f"{s.op.value}{s.micro_batch}@s{s.stage}" for s in zbv_order(r, 2, 3)))
    F0@s0 F1@s0 F2@s0 F0@s3 I0@s3 W0@s3 F1@s3 I1@s3 W1@s3 I0@s0 W0@s0 F2@s3 I2@s3 W2@s3 I1@s0 W1@s0 I2@s0 W2@s0
    F0@s1 F0@s2 F1@s1 F1@s2 I0@s2 W0@s2 F2@s1 I0@s1 W0@s1 F2@s2 I1@s2 W1@s2 I1@s1 I2@s2 I2@s1 W1@s1 W2@s2 W2@s1
    """
    forward, grad_input, grad_weight = ZeroBubbleOp.FORWARD, ZeroBubbleOp.INPUT, ZeroBubbleOp.WEIGHT
    down, up = position, 2 * positions - 1 - position
    order = _VOrder(micro_batches)
    for _ in range(2 * (positions - position) - 1):
        order.run(forward, down)
    for _ in range(position):
        order.run(forward, up)
        order.run(forward, down)
    for _ in range(positions - position):
        for op in (forward, grad_input, grad_weight):
            order.run(op, up)
    while order.owed(forward, up):
        for stage in (down, up):
            for op in (forward, grad_input, grad_weight):
                order.run(op, stage)
    for _ in range(position):
        order.run(grad_input, down)
        order.run(grad_input, up)
    for _ in range(positions - position):
        order.run(grad_input, down)
        order.run(grad_weight, down)
    while order.owed(grad_input, down) or order.owed(grad_input, up):
        order.run(grad_input, up)
        order.run(grad_input, down)
    for stage in (up, down):
        while order.owed(grad_weight, stage):
            order.run(grad_weight, stage)
    return order.steps
