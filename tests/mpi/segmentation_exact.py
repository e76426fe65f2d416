"""MPI: U-Net segmentation on tiles == one process (float64, 3 SGD-momentum steps), every dense loss.

Usage: python -m tests.mpi.segmentation_exact [--backend=gloo] CASE [CASE ...] (each case needs exactly this
many ranks).
Named checks: each CASE (losses and the whole state on rank 0, equal to the serial reference of its
chunks), ``<CASE> copies`` (every rank's own copy of every stage it holds), ``<CASE> eval tiles`` (the
forward-only outputs of ``evaluate_tiles`` equal the serial model's in eval mode, each rank's tile),
and ``classifier loss refused`` (every stage spatial, a class loss on a U-Net's output tiles: refused at the
first forward).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.loss import DenseLoss
from mpi4dl_nb.models.unet import unet
from mpi4dl_nb.pipeline.reference import serial_chunks, serial_step
from tests.support.checks import Checks, run_checks
from tests.support.dense_exact import check_copies, dense_batches, final_error, momentum_sgd
from tests.support.planes import split_backend

RTOL = 1e-9
STEPS = 3
IGNORE = 255
CLASSES = 3
IMAGE = 16

# name -> (ParallelConfig knobs, batch, U-Net options, loss)
CASES: dict[str, tuple[dict[str, object], int, dict[str, object], DenseLoss]] = {
    "sp4": (dict(split_size=1, spatial_size=1, num_spatial_parts=4), 2,
            dict(norm="batch", upsampling="bilinear"), DenseLoss("ce+dice", (1.0, 2.0, 0.5), IGNORE)),
    "sp2_sp2_pp_1f1b": (dict(split_size=2, spatial_size=2, num_spatial_parts=2, slice_method="vertical", parts=2,
                             schedule="1f1b", balance=(3, 3)), 4,
                        dict(norm="group", upsampling="transposed"), DenseLoss("dice", None, IGNORE)),
    "sp2_sp2_gems_d2": (dict(split_size=2, spatial_size=2, num_spatial_parts=2, slice_method="horizontal", times=1,
                             balance=(2, 4), halo_d2=True, fused_layers=2), 2,
                        dict(norm="batch", upsampling="bilinear"), DenseLoss("ce", None, None)),
    "sp2_dp2_syncbn": (dict(split_size=1, spatial_size=1, num_spatial_parts=2, slice_method="vertical",
                            data_parallel=2, sync_batchnorm=True), 4,
                       dict(norm="batch", upsampling="transposed"), DenseLoss("ce+dice", None, IGNORE)),
    "sp3_lp_d2": (dict(split_size=2, spatial_size=1, num_spatial_parts=3, slice_method="horizontal", balance=(2, 4),
                       halo_d2=True, fused_layers=2), 2,
                  dict(norm="batch", upsampling="bilinear"), DenseLoss("ce+dice", (1.0, 2.0, 0.5), IGNORE)),
    "sp4_recompute": (dict(split_size=1, spatial_size=1, num_spatial_parts=4, checkpoint_activations="every"), 2,
                      dict(norm="group", upsampling="bilinear"), DenseLoss("ce", (0.5, 1.0, 2.0), IGNORE)),
}


def layers(options: dict[str, object], seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [layer.double() for layer in unet(2, 2, CLASSES, **options)]   # type: ignore[arg-type]


def run_case(ctx, name: str, check: Checks) -> str:
    knobs, batch, options, loss = CASES[name]
    cfg = dl.ParallelConfig(**knobs)
    data = dense_batches(STEPS, batch, 3, (IMAGE, IMAGE), CLASSES, len(name), loss.ignore_index)
    engine = dl.HybridEngine(layers(options), cfg, ctx, loss_fn=loss, optimizer=momentum_sgd)
    losses = [engine.train_step(x, y) for x, y in data]
    state = engine.full_state_dict()
    serial = nn.Sequential(*layers(options))
    opt = momentum_sgd(serial.parameters())
    chunks = serial_chunks(cfg, batch)
    want_losses = [serial_step(serial, opt, loss, x, y, chunks) for x, y in data]
    want_state = {k: v.detach().clone() for k, v in serial.state_dict().items()}
    check_copies(check, ctx, engine, name, want_state, RTOL)
    with check(f"{name} eval tiles") as result:
        x = data[0][0]
        serial.eval()
        with torch.no_grad():
            want = serial(x)
        grid = engine.grid
        for out in engine.evaluate_tiles(x):
            got = out.output
            expected = want[out.rows]
            if out.tile is not None:
                assert grid is not None
                r0, r1, c0, c1 = grid.tile_box(out.tile, IMAGE, IMAGE)
                expected = expected[..., r0:r1, c0:c1]
            err = (got - expected).abs().max().item() / expected.abs().max().item()
            assert err < RTOL, f"rows {out.rows} tile {out.tile}: relative error {err:.2e}"
        result.detail = "tiles" if cfg.all_spatial else "whole outputs"
    worst = final_error(ctx, name, losses, want_losses, state, want_state,
                        nn.Sequential(*layers(options)).state_dict(), RTOL)
    return f"losses {[round(v, 6) for v in losses]}, max rel err {worst:.2e}"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, names = split_backend(sys.argv[1:])
    ctx = dl.init(backend=backend)
    for name in names:
        with check(name) as result:
            result.detail = run_case(ctx, name, check)
    with check("classifier loss refused") as result:
        cfg = dl.ParallelConfig(split_size=1, spatial_size=1, num_spatial_parts=ctx.world_size,
                                slice_method="vertical")
        engine = dl.HybridEngine(layers({}), cfg, ctx, loss_fn=nn.CrossEntropyLoss(), abort_on_error=False)
        x, y = dense_batches(1, 2, 3, (IMAGE, IMAGE), CLASSES, 0, None)[0]
        try:   # a class loss takes the joined logits of a classifier's head; a U-Net's output is still tiles
            engine.train_step(x, y)
        except ConfigError as err:
            assert err.knob == "spatial_size" and "DenseLoss" in str(err), err
            result.detail = str(err)[:80]
        else:
            raise AssertionError("an all-spatial engine took nn.CrossEntropyLoss on a U-Net's tiles")
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
