"""Zero-bubble ZB-H1 order of one pipeline stage: 1F1B with the backward split into I and W (pure).

Qi et al. 2024, "Zero Bubble Pipeline Parallelism": a backward is two ops, ``I`` (the gradient of
the stage input, which the previous stage waits for) and ``W`` (the parameter gradients, which
nobody waits for). ZB-H1 keeps 1F1B's warm-up and its number of micro-batches in flight per stage
(a micro-batch holds its activations from its ``F`` until its ``W``), and runs ``I`` as soon as it
can: the ``I`` s travel back through the pipeline at the speed of one op per stage, and a stage
fills the time it waits for the next ``I`` with the ``W`` it owes. With ``F = I = W`` the idle time
of a stage is ``(S-1) x F`` instead of 1F1B's ``3 (S-1) x F`` (a third). The price: stage ``s``
holds up to ``S`` micro-batches' activations (1F1B: ``S - s``), so the pipeline's peak (stage 0's)
is 1F1B's, a later stage's is higher.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TypeVar

Item = TypeVar("Item")


class ZeroBubbleOp(Enum):
    """One op of a split backward schedule: forward, input gradient, weight gradient."""

    FORWARD = "F"
    INPUT = "I"
    WEIGHT = "W"


def zb1_order(stage: int, num_stages: int, items: Sequence[Item], warmup_scale: int = 1
              ) -> list[tuple[ZeroBubbleOp, Item]]:
    """The ZB-H1 order of ``stage`` (of ``num_stages``) over ``items`` (micro-batches, in order).

    Warm-up: ``(num_stages - 1 - stage) x warmup_scale`` forwards (1F1B's); then each forward is
    followed by the ``I`` of the oldest micro-batch, then the drain's ``I`` s; every ``I`` is followed
    by the ``W`` of the micro-batch ``stage x warmup_scale`` places before it (the lag that lets a later
    stage send its ``I`` back before doing its ``W``), the owed ``W`` s close. In flight (``F`` done,
    ``W`` not): at most ``num_stages x warmup_scale`` micro-batches on every stage - 1F1B's peak
    (its first stage's), which stage 0 keeps and later stages reach.

    >>> " ".join(f"{op.value}{u}" for op, u in zb1_order(0, 2, [0, 1, 2, 3]))
    'F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3'
    >>> " ".join(f"{op.value}{u}" for op, u in zb1_order(1, 2, [0, 1, 2, 3]))
    'F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3'
    """
    forward, grad_input, grad_weight = ZeroBubbleOp.FORWARD, ZeroBubbleOp.INPUT, ZeroBubbleOp.WEIGHT
    count = len(items)
    warmup = min((num_stages - 1 - stage) * warmup_scale, count)
    lag = stage * warmup_scale
    order = [(forward, item) for item in items[:warmup]]
    for j in range(count):
        if warmup + j < count:
            order.append((forward, items[warmup + j]))
        order.append((grad_input, items[j]))
        if j >= lag:
            order.append((grad_weight, items[j - lag]))
    return order + [(grad_weight, item) for item in items[max(0, count - lag):]]
