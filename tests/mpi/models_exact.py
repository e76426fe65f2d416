"""5 ranks: each model family x 3 sizes trains exactly like one process (float64).

SP+LP (split 2, spatial 1, 2x2 tiles) for all nine models; LP+PP+GEMS (split 5, parts 2,
times 1) for the smallest of each family; and the spatial stage alone with fused halos (D2)
through the shared exactness helper. Compared each step: loss, every parameter gradient,
then the updated weights and BatchNorm statistics (full state dict), over two SGD-momentum steps
(one for the larger sizes).
The serial reference runs the batch in the engine's ``cfg.batch_divisor`` chunks, in order, with
gradient accumulation (BatchNorm sees each chunk, as in the pipeline).
Named checks: ``check_names()`` (one per model and configuration, one per spatial stage).

Usage: python -m tests.mpi.models_exact [--backend=gloo] [--smallest]: ``--smallest`` runs only
the smallest size of each family (``check_names(smallest=True)``), e.g. on the torch plane.
"""
from __future__ import annotations

import copy
import sys

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.models import amoebanet, resnet_v1, resnet_v2
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact, relative_error
from tests.support.planes import split_backend

# float64 roundoff of different (tiled) summation orders, amplified by BatchNorm on 2x2 maps
# of batch-2 chunks through 20+ layers, reaches ~1e-9; any real error is orders larger.
RTOL = 1e-8
SIZES = {"resnet_v1": [8, 14, 20], "resnet_v2": [11, 20, 29], "amoebanet": [3, 6, 9]}
IMAGE = {"resnet_v1": 32, "resnet_v2": 32, "amoebanet": 64}
SP_LP = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")
LP_PP_GEMS = dl.ParallelConfig(split_size=5, spatial_size=0, parts=2, times=1)


def training_label(family: str, size: int, cfg: dl.ParallelConfig) -> str:
    return f"{family}-{size} {cfg.split_size}/{cfg.spatial_size}/{cfg.parts}/{cfg.times}"


def spatial_label(family: str) -> str:
    return f"{family} spatial stage with fused halos (D2)"


def sizes_run(smallest: bool) -> dict[str, list[int]]:
    return {family: sizes[:1] if smallest else sizes for family, sizes in SIZES.items()}


def check_names(smallest: bool = False) -> list[str]:
    """SP+LP for every size, LP+PP+GEMS for the smallest, the fused spatial stage: per family."""
    return [*(training_label(family, size, SP_LP) for family, sizes in sizes_run(smallest).items()
              for size in sizes),
            *(training_label(family, sizes[0], LP_PP_GEMS) for family, sizes in SIZES.items()),
            *map(spatial_label, SIZES)]


def build(family: str, size: int) -> list[nn.Module]:
    torch.manual_seed(size)
    if family == "resnet_v1":
        layers = resnet_v1(size, 5, width=4)
    elif family == "resnet_v2":
        layers = resnet_v2(size, 5, width=4)
    else:
        layers = amoebanet(size, 8, 5)
    return [layer.double() for layer in layers]


def assert_close(ctx, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    err = relative_error(actual, expected)
    if not err <= RTOL:
        raise AssertionError(f"rank {ctx.rank}: {what}: relative error {err:.3e} > {RTOL:.0e}")


def compare_training(ctx, family: str, size: int, cfg: dl.ParallelConfig, batch: int,
                     steps: int = 2) -> None:
    layers = build(family, size)
    serial = nn.Sequential(*copy.deepcopy(layers))
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    engine = dl.HybridEngine(copy.deepcopy(layers), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    reference_params = dict(serial.named_parameters())
    gen = torch.Generator().manual_seed(7)
    label = training_label(family, size, cfg)
    for step in range(steps):
        x = torch.randn(batch, 3, IMAGE[family], IMAGE[family], generator=gen, dtype=torch.float64)
        y = torch.randint(0, 5, (batch,), generator=gen)
        loss = engine.train_step(x, y)
        serial_opt.zero_grad()
        ref_loss = torch.zeros((), dtype=torch.float64)
        chunk = batch // cfg.batch_divisor      # the engine's contract: chunks in order,
        for lo in range(0, batch, chunk):       # gradients accumulated (BN per chunk)
            part = nn.functional.cross_entropy(serial(x[lo:lo + chunk]), y[lo:lo + chunk])
            (part * (chunk / batch)).backward()
            ref_loss += part.detach() * (chunk / batch)
        assert_close(ctx, f"{label} step {step} loss", torch.tensor(loss, dtype=torch.float64),
                     ref_loss.detach())
        compared = 0
        for inst in engine.instances.values():
            for name, param in inst.canonical.named_parameters():
                ref = reference_params[inst.canonical.full_key(name)]
                assert_close(ctx, f"{label} step {step} grad {inst.canonical.full_key(name)}",
                             param.grad, ref.grad)
                compared += 1
        if compared == 0:
            raise AssertionError(f"rank {ctx.rank}: {label}: no parameters compared")
        serial_opt.step()
        state = engine.full_state_dict()
        if ctx.rank == 0:
            reference = serial.state_dict()
            if set(state) != set(reference):
                raise AssertionError(f"{label}: state keys differ: {set(state) ^ set(reference)}")
            for key, value in reference.items():
                assert_close(ctx, f"{label} step {step} state {key}", state[key].double(),
                             value.double())


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, args = split_backend(sys.argv[1:])
    ctx = dl.init(backend=backend)
    for family, sizes in sizes_run("--smallest" in args).items():
        for size in sizes:   # the momentum step (2nd) only for the smallest: keeps the test short
            with check(training_label(family, size, SP_LP)):
                compare_training(ctx, family, size, SP_LP, batch=2,
                                 steps=2 if size == sizes[0] else 1)
        with check(training_label(family, sizes[0], LP_PP_GEMS)):
            compare_training(ctx, family, sizes[0], LP_PP_GEMS, batch=4)
    # the first layers alone, spatialized with fused (D2) halos, via the shared helper
    tiles = ctx.new_group([0, 1, 2, 3])
    grid = dl.TileGrid.from_slice_method("square", 4)
    for family in SIZES:
        layers = build(family, SIZES[family][0])
        front = nn.Sequential(*layers[:3])
        x = torch.randn(2, 3, IMAGE[family], IMAGE[family], dtype=torch.float64,
                        generator=torch.Generator().manual_seed(3))
        if ctx.rank < 4:
            with check(spatial_label(family)):
                check_spatial_exact(front, grid, x, ctx, tiles, rtol=RTOL, what=f"{family} D2",
                                    halo_d2=True, fused_layers=2)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
