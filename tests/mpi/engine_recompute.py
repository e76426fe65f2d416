"""MPI (5 ranks): activation recomputation and mixed precision in HybridEngine.

Usage: python -m tests.mpi.engine_recompute [--backend=gloo] [CASE ...] (recompute cases
to run, default all; naming cases also skips the memory, bf16 and fp16 checks unless ``bf16``
is named too)

Named checks:

* ``recompute <case>``: the engine with ``checkpoint_activations`` gives bit-identical losses
  and the same whole state (weights, BatchNorm running stats, counters; max relative error 0
  expected, 1e-12 allowed) as without, after 3 SGD-momentum steps, and both equal the serial
  reference (engine_exact's rule, 1e-9); every rank makes as many halo exchanges with as without
  (the recomputation replays the received strips).
* ``recompute memory``: on the spatial ranks of SP 2x2 + LP (ResNet stem and 3 blocks on the
  tiles) the counted activation peak (ActivationMeter: bytes saved for backward, recomputation
  included) with ``checkpoint_activations='every'`` is at most 0.7x the peak without.
* ``bf16 vs fp32``: float32 model, SP 2x2 + LP, 2 steps: bf16 loss within 5% of fp32.
* ``bf16 vs serial``: the same bf16 run against serial training under the same autocast:
  losses within 1e-2 relative, each tensor of the state within twice bf16's own distance from
  fp32 (tests/support/bf16_rule.py).
* ``fp16 refused``: ``precision='fp16'`` on CPU raises ConfigError naming the GPU.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.measure.usage import ActivationMeter
from tests.mpi.engine_exact import RTOL, batches, serial, sgd, state_error
from tests.support.bf16_rule import bf16_loss_error, bf16_state_error, pin_bf16_kernels
from tests.support.checks import Checks, run_checks
from tests.support.engine_cases import serial_chunks
from tests.support.models import build

# name -> (ParallelConfig kwargs, model, global batch, image, checkpoint setting)
CASES: dict[str, tuple[dict, str, int, int, str | int]] = {
    "sp_lp_square every": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, balance=(4, 1)),
                           "resnet", 2, 16, "every"),
    "sp_pp_1f1b blocks": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, parts=2,
                               schedule="1f1b", balance=(2, 3)), "resnet", 4, 16, "blocks"),
    "sp_se_pp 2": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, parts=2, schedule="1f1b",
                        balance=(3, 2)), "se_resnet", 4, 16, 2),
    "sp_unet_lp every": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, balance=(3, 3)),
                         "unet", 2, 16, "every"),
    "sp_gems_pp every": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, times=1, parts=2,
                              balance=(2, 3)), "resnet", 4, 16, "every"),
}


def halo_count(ctx) -> int:
    total = ctx.tracer.totals().get("halo")
    return total.count if total else 0


def train(ctx, kwargs: dict, model_name: str, data, model_dtype=torch.float64
          ) -> tuple[list[float], dict | None, int]:
    """Losses, the whole state (rank 0) and this rank's counted activation peak."""
    layers = [layer.to(model_dtype) for layer in build(model_name)]
    meter = ActivationMeter(exclude=[p for layer in layers for p in layer.parameters()])
    engine = dl.HybridEngine(layers, dl.ParallelConfig(**kwargs), ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=sgd)
    losses = []
    for x, y in data:
        with meter:
            losses.append(engine.train_step(x.to(model_dtype), y))
    return losses, engine.full_state_dict(), meter.peak


def check_recompute(ctx, name: str) -> str:
    kwargs, model_name, batch, image, setting = CASES[name]
    data = batches(model_name, batch, image, seed=len(name))
    start = halo_count(ctx)
    plain_losses, plain_state, _ = train(ctx, kwargs, model_name, data)
    middle = halo_count(ctx)
    losses, state, _ = train(ctx, dict(kwargs, checkpoint_activations=setting), model_name, data)
    # the recomputation replays the received halos: exactly the plain run's exchanges
    if ctx.rank == 0 and middle == start:
        raise AssertionError(f"{name}: no halo exchange traced on tile rank 0")
    if halo_count(ctx) - middle != middle - start:
        raise AssertionError(f"{name}: {halo_count(ctx) - middle} halo exchanges with recomputation, "
                             f"{middle - start} without")
    if ctx.rank != 0:
        return "rank 0 compares"
    if losses != plain_losses:
        raise AssertionError(f"{name}: losses {losses} != without recomputation {plain_losses}")
    err = state_error(state, plain_state, name, 1e-12)
    want_losses, want_state = serial(model_name, data, serial_chunks(dl.ParallelConfig(**kwargs), batch))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    if worst > RTOL:
        raise AssertionError(f"{name}: losses {losses} != serial {want_losses}")
    serial_err = state_error(state, want_state, name, RTOL)
    return f"vs plain engine {err:.1e}, vs serial {max(worst, serial_err):.1e}"


def check_memory(ctx) -> str:
    kwargs = dict(split_size=2, spatial_size=1, num_spatial_parts=4, balance=(4, 1))
    data = batches("resnet", 2, 64, seed=3)[:1]
    peaks = [train(ctx, dict(kwargs, checkpoint_activations=setting), "resnet", data)[2]
             for setting in (None, "every")]
    spatial = ctx.rank < 4
    ratio = peaks[1] / peaks[0]
    if spatial and ratio > 0.7:
        raise AssertionError(f"spatial rank {ctx.rank}: peak {peaks[1]} B with recomputation vs "
                             f"{peaks[0]} B without ({ratio:.2f}x > 0.7x)")
    role = "spatial" if spatial else "LP"
    return f"{role} rank: {peaks[0] / 2**10:.0f} KiB -> {peaks[1] / 2**10:.0f} KiB ({ratio:.2f}x)"


def bf16_runs(ctx) -> tuple[list[float], list[float], dict | None, list, int]:
    kwargs = dict(split_size=2, spatial_size=1, num_spatial_parts=4, balance=(4, 1))
    data = batches("resnet", 2, 32, seed=5)[:2]
    fp32, _, _ = train(ctx, kwargs, "resnet", data, model_dtype=torch.float32)
    bf16, state, _ = train(ctx, dict(kwargs, precision="bf16"), "resnet", data, model_dtype=torch.float32)
    return fp32, bf16, state, data, 2


def serial_float32(data, autocast: bool) -> tuple[list[float], dict]:
    """Serial training of the float32 model, under bf16 autocast or not."""
    model = nn.Sequential(*build("resnet")).float()
    opt = sgd(model.parameters())
    losses = []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.CrossEntropyLoss()(model(x.float()), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    ctx = dl.init(backend=options.get("backend", "auto"))
    chosen = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name in CASES:
        if chosen and name not in chosen:
            continue
        with check(f"recompute {name}") as result:
            result.detail = check_recompute(ctx, name)
    if not chosen:
        with check("recompute memory") as result:
            result.detail = check_memory(ctx)
    if not chosen or "bf16" in chosen:
        check_bf16(ctx, check)
    if not chosen:
        check_fp16_refused(ctx, check)
    ctx.barrier()


def check_bf16(ctx, check: Checks) -> None:
    fp32, bf16, state, data, _ = bf16_runs(ctx)
    with check("bf16 vs fp32") as result:
        gap = abs(bf16[-1] - fp32[-1]) / abs(fp32[-1])
        if bf16 == fp32:
            raise AssertionError("bf16 gave the float32 losses bit for bit: autocast did not apply")
        if gap > 0.05:
            raise AssertionError(f"bf16 loss {bf16} vs fp32 {fp32}: {gap:.1%} apart after 2 steps")
        result.detail = f"fp32 {fp32}, bf16 {bf16}: {gap:.2%} apart"
    with check("bf16 vs serial") as result:
        if ctx.rank == 0:
            want_losses, want_state = serial_float32(data, autocast=True)
            _, fp32_state = serial_float32(data, autocast=False)
            loss_err = bf16_loss_error(bf16, want_losses)
            worst = bf16_state_error(state, want_state, fp32_state)
            result.detail = f"loss rel err {loss_err:.1e}, worst state error / bf16 noise {worst:.2f}"


def check_fp16_refused(ctx, check: Checks) -> None:
    with check("fp16 refused"):
        try:
            dl.HybridEngine(build("resnet"), dl.ParallelConfig(split_size=2, spatial_size=1,
                                                                num_spatial_parts=4, precision="fp16"),
                            ctx, loss_fn=nn.CrossEntropyLoss(), abort_on_error=False)
        except ConfigError as err:
            assert "GPU" in str(err) and "bf16" in str(err), err
        else:
            raise AssertionError("fp16 on CPU was not refused")


if __name__ == "__main__":
    pin_bf16_kernels()     # before the first convolution (tests/support/bf16_rule.py)
    run_checks(main)
