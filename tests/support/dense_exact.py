"""What the dense (U-Net) exactness programs share: seeded batches of images or volumes with labels, the optimizer,
and the comparison of a trained engine's every copy, losses and final state with one process."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tests.mpi.engine_exact import state_error
from tests.support.checks import Checks


def dense_batches(steps: int, batch: int, channels: int, spatial: Sequence[int], classes: int, seed: int,
                  ignore: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` float64 batches (batch, channels, *spatial) with labels (batch, *spatial), ~10% ``ignore``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, channels, *spatial, generator=gen, dtype=torch.float64)
        y = torch.randint(0, classes, (batch, *spatial), generator=gen)
        if ignore is not None:
            y[torch.rand(y.shape, generator=gen) < 0.1] = ignore
        out.append((x, y))
    return out


def momentum_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def check_copies(check: Checks, ctx, engine, name: str, want_state: dict[str, torch.Tensor] | None,
                 rtol: float) -> None:
    """Every stage copy this rank holds equals one process' final state (``want_state`` given on rank 0)."""
    with check(f"{name} copies") as result:
        mine = engine.scatter_to_holders(want_state if ctx.rank == 0 else None)
        worst = 0.0
        for inst in engine.instances.values():
            held = inst.canonical.full_state_dict()
            worst = max(worst, state_error(held, {k: mine[k] for k in held}, f"{name} rank {ctx.rank}", rtol))
        result.detail = f"stages {engine.held_stages()}, max rel err {worst:.2e}"


def final_error(ctx, name: str, losses: list[float], want_losses: list[float], state: dict[str, torch.Tensor],
                want_state: dict[str, torch.Tensor], initial_state: dict[str, torch.Tensor], rtol: float) -> float:
    """The worst relative error of the losses (every rank) and the final state (rank 0) against one process;
    raises past ``rtol`` or when training barely moved the weights (a comparison that could not fail)."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    if worst > rtol:
        raise AssertionError(f"{name}: losses {losses} != serial {want_losses}")
    if ctx.rank == 0:
        worst = max(worst, state_error(state, want_state, name, rtol))
        moved = state_error(want_state, initial_state, name, None)
        assert moved > 1e-4, f"{name}: training barely moved the weights ({moved:.1e})"
    return worst
