"""MPI: HybridEngine == serial nn.Sequential training (float64, 3 SGD-momentum steps).

Usage: python -m tests.mpi.engine_exact [--backend=gloo] [--random=N] CASE [CASE ...] (each
case needs exactly this many ranks; ``--random=N`` adds N random configurations of this world
size, ``random <world>-<i>``). Named checks: each CASE (losses and the whole state on rank 0),
``<CASE> copies`` (on every rank: its own copy of every stage it holds, tiles, GEMS mirrors,
local-DP copies and replicas, equals the serial state), then ``round trip <first CASE>``.

Serial reference: the global batch cut into the engine's micro-batches (``serial_chunks``:
``cfg.batch_divisor`` consecutive chunks; with sync_batchnorm each micro-batch is the union
of its data-parallel copies' chunks), run in order with gradient accumulation (each
micro-batch's mean loss scaled by its share of the global batch), then one optimizer step.
Compared: every step's loss and every parameter and buffer (weights, BatchNorm running
stats, num_batches_tracked) to 1e-9 relative (denominator: the tensor's max |value|, at
least 1e-6).
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.pipeline.reference import serial_step
from tests.support.checks import Checks, run_checks
from tests.support.engine_cases import CASES, random_cases, serial_chunks
from tests.support.models import build, labels

RTOL = 1e-9
FLOOR = 1e-6   # denominators below this are roundoff-sized (e.g. a bias whose gradient is ~0)
STEPS = 3
LR, MOMENTUM = 0.1, 0.9


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def batches(model_name: str, batch: int, image: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, image, image, generator=gen, dtype=torch.float64),
             labels(model_name, batch, image, gen)) for _ in range(STEPS)]


def serial(model_name: str, data, chunks: list[list[int]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Serial training over ``chunks`` (sample indices of each micro-batch, in order)."""
    model = nn.Sequential(*build(model_name))
    opt = sgd(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    losses = [serial_step(model, opt, loss_fn, x, y, chunks) for x, y in data]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def consecutive(batch: int, count: int) -> list[list[int]]:
    size = batch // count
    return [list(range(j * size, (j + 1) * size)) for j in range(count)]


def round_trip_name(case: str) -> str:
    return f"round trip {case}"


def copies_name(case: str) -> str:
    return f"{case} copies"


def run_case(ctx, name: str, check: Checks, cases: dict) -> str:
    kwargs, model_name, batch, image = cases[name]
    cfg = dl.ParallelConfig(**kwargs)
    data = batches(model_name, batch, image, seed=len(name))
    start = time.perf_counter()
    engine = dl.HybridEngine(build(model_name), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=sgd)
    losses = [engine.train_step(x, y) for x, y in data]
    state = engine.full_state_dict()
    seconds = time.perf_counter() - start
    chunks = serial_chunks(cfg, batch)
    want_losses, want_state = serial(model_name, data, chunks) if ctx.rank == 0 else (None, None)
    with check(copies_name(name)) as result:   # every rank: its own copies of its stages
        mine = engine.scatter_to_holders(want_state)
        worst = 0.0
        for inst in engine.instances.values():
            held = inst.canonical.full_state_dict()
            worst = max(worst, state_error(held, {k: mine[k] for k in held}, f"{name} rank "
                                           f"{ctx.rank} stage {inst.stage} copy {inst.replica}",
                                           RTOL))
        result.detail = f"stages {engine.held_stages()}, max rel err {worst:.2e}"
    if ctx.rank != 0:
        return "rank 0 compares"
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
    control_chunks = consecutive(batch, 1) if len(chunks) > 1 else \
        (consecutive(batch, cfg.batch_divisor) if cfg.batch_divisor > 1 else None)
    if control_chunks is not None and _has_batchnorm(model_name):
        _, control_state = serial(model_name, data, control_chunks)   # must NOT match
        control = state_error(state, control_state, name, None)
        if control <= RTOL:
            raise AssertionError(f"{name}: control failed, a differently chunked serial run also matches")
    return f"world {cfg.world_size}, max rel err {worst:.2e}, {seconds:.2f}s"


def _has_batchnorm(model_name: str) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for layer in build(model_name)
               for m in layer.modules())


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


def check_round_trip(ctx, name: str, cases: dict) -> None:
    """load_full_state_dict(full_state_dict of another model) then full_state_dict again."""
    kwargs, model_name = cases[name][0], cases[name][1]
    engine = dl.HybridEngine(build(model_name, seed=0), dl.ParallelConfig(**kwargs), ctx,
                             loss_fn=nn.CrossEntropyLoss())
    other = nn.Sequential(*build(model_name, seed=7)).state_dict() if ctx.rank == 0 else None
    engine.load_full_state_dict(other)
    back = engine.full_state_dict()
    if ctx.rank == 0:
        for key, value in other.items():
            if not torch.equal(back[key], value):
                raise AssertionError(f"{name}: round trip changed {key}")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    ctx = dl.init(backend=options.get("backend", "auto"))
    cases = dict(CASES)
    if "random" in options:
        extra = random_cases(ctx.world_size, int(options["random"]))
        cases.update(extra)
        names += list(extra)
    for name in names:
        if name.startswith("random ") and name not in cases:   # replay one: 'random <world>-<i>'
            cases.update(random_cases(ctx.world_size, int(name.rsplit("-", 1)[1]) + 1))
    for name in names:
        with check(name) as result:
            try:
                result.detail = run_case(ctx, name, check, cases)
            except Exception:
                if name.startswith("random "):
                    print(f"replay {name} ({cases[name]}): mpiexec -n {ctx.world_size} python -m "
                          f"mpi4py -m tests.mpi.engine_exact '{name}'", file=sys.stderr, flush=True)
                raise
    with check(round_trip_name(names[0])):
        check_round_trip(ctx, names[0], cases)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
