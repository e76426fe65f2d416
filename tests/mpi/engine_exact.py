"""MPI: HybridEngine == serial nn.Sequential training (float64, 3 SGD-momentum steps).

Usage: python -m tests.mpi.engine_exact [--backend=gloo] CASE [CASE ...]  (each case needs
exactly this many ranks). Named checks: each CASE, then ``round trip <first CASE>``.

Serial reference: the global batch cut into ``cfg.batch_divisor`` equal consecutive chunks,
run in chunk order with gradient accumulation (each chunk's mean loss scaled by
chunk/global batch), then one optimizer step. Checked on rank 0: every step's loss and
the whole state dict (weights, BatchNorm running stats, num_batches_tracked) to 1e-9
relative (denominator: the tensor's max |value|, at least 1e-6).
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import mpi4dl_nb as dl
from tests.support.checks import Checks, run_checks
from tests.support.engine_cases import CASES, config_of
from tests.support.models import build
from tests.support.planes import split_backend

RTOL = 1e-9
FLOOR = 1e-6   # denominators below this are roundoff-sized (e.g. a bias whose gradient is ~0)
STEPS = 3
LR, MOMENTUM = 0.1, 0.9


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def batches(batch: int, image: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, image, image, generator=gen, dtype=torch.float64),
             torch.randint(0, 5, (batch,), generator=gen)) for _ in range(STEPS)]


def serial(model_name: str, data, chunks: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = nn.Sequential(*build(model_name))
    opt = sgd(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for x, y in data:
        opt.zero_grad()
        size = x.shape[0] // chunks
        total = 0.0
        for j in range(chunks):
            part = slice(j * size, (j + 1) * size)
            loss = loss_fn(model(x[part]), y[part]) * (size / x.shape[0])
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def round_trip_name(case: str) -> str:
    return f"round trip {case}"


def run_case(ctx, name: str) -> str:
    kwargs, model_name, batch, image = CASES[name]
    cfg = config_of(name)
    data = batches(batch, image, seed=len(name))
    start = time.perf_counter()
    engine = dl.HybridEngine(build(model_name), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=sgd)
    losses = [engine.train_step(x, y) for x, y in data]
    state = engine.full_state_dict()
    seconds = time.perf_counter() - start
    every = ctx.all_gather_object(losses)
    if any(other != losses for other in every):
        raise AssertionError(f"{name}: ranks returned different losses: {every}")
    if ctx.rank != 0:
        return "same losses as rank 0"
    want_losses, want_state = serial(model_name, data, cfg.batch_divisor)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    if worst > RTOL:
        raise AssertionError(f"{name}: losses {losses} != serial {want_losses}")
    if list(state) != list(want_state):
        raise AssertionError(f"{name}: state keys differ: {sorted(set(state) ^ set(want_state))}")
    worst = max(worst, state_error(state, want_state, name, RTOL))
    initial = nn.Sequential(*build(model_name)).state_dict()
    moved = state_error(want_state, initial, name, None)
    if moved < 1e-4:
        raise AssertionError(f"{name}: training barely moved the weights ({moved:.1e})")
    if cfg.batch_divisor > 1:   # control: a differently chunked serial run must NOT match
        _, one_chunk = serial(model_name, data, 1)
        control = state_error(state, one_chunk, name, None)
        if control <= RTOL:
            raise AssertionError(f"{name}: control failed, 1-chunk serial also matches")
    return f"world {cfg.world_size}, max rel err {worst:.2e}, {seconds:.2f}s"


def state_error(state: dict, want_state: dict, name: str, rtol: float | None) -> float:
    """Largest relative error over all entries; raises above ``rtol`` (None: never)."""
    worst = 0.0
    for key, want in want_state.items():
        if want.is_floating_point():
            scale = max(want.abs().max().item() if want.numel() else 0.0, FLOOR)
            err = (state[key] - want).abs().max().item() / scale if want.numel() else 0.0
        else:
            err = float((state[key] != want).any())
        worst = max(worst, err)
        if rtol is not None and not err <= rtol:
            raise AssertionError(f"{name}: {key} relative error {err:.3e} > {rtol:.0e}")
    return worst


def check_round_trip(ctx, name: str) -> None:
    """load_full_state_dict(full_state_dict of another model) then full_state_dict again."""
    cfg = config_of(name)
    model_name = CASES[name][1]
    engine = dl.HybridEngine(build(model_name, seed=0), cfg, ctx, loss_fn=nn.CrossEntropyLoss())
    other = nn.Sequential(*build(model_name, seed=7)).state_dict() if ctx.rank == 0 else None
    engine.load_full_state_dict(other)
    back = engine.full_state_dict()
    if ctx.rank == 0:
        for key, value in other.items():
            if not torch.equal(back[key], value):
                raise AssertionError(f"{name}: round trip changed {key}")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, names = split_backend(sys.argv[1:], default="auto")
    ctx = dl.init(backend=backend)
    for name in names:
        with check(name) as result:
            result.detail = run_case(ctx, name)
    with check(round_trip_name(names[0])):
        check_round_trip(ctx, names[0])
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
