"""No silent wrong answer on tiles: SE gates, U-Net, GroupNorm/InstanceNorm, transposed convs,
up-sampling exact (float64, 1e-10); functional window ops in custom forwards refused; a
per-pixel loss on tiles equal to the serial loss; random CNNs exact or refused.

Usage: python -m tests.mpi.spatial_correctness ROWS COLS [--fuzz=N] [--seed=S] [--only=NAME,...] [--backend=NAME]
Named checks: ``check_names(ROWS, COLS, N)``. A fuzz case that fails prints its seed and the
command replaying it alone (``--seed=S --fuzz=1``).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.convert import reduce_tile_gradients, spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles
from tests.support.checks import Checks, run_checks
from tests.support.dense_models import FunctionalOp, Sequence, functional_ops, spatial_models, unet_layers
from tests.support.exactness import check_spatial_exact, relative_error
from tests.support.fuzz import fuzz_case_names, run_fuzz_case

SIZES = [(40, 48), (36, 44)]


def sizes(rows: int, cols: int) -> list[tuple[int, int]]:
    """Image sizes of the fixed models (one on large grids, to keep the launch short)."""
    return SIZES if rows * cols < 9 else SIZES[1:]
RTOL = 1e-10


def exact_name(model: str, size: tuple[int, int]) -> str:
    return f"{model} {size[0]}x{size[1]}"


def refusal_name(op: str) -> str:
    return f"refuses {op} in a custom forward"


LOSS = "per-pixel loss on tiles (U-Net)"


def check_names(rows: int, cols: int, fuzz: int = 0, seed: int | None = None) -> list[str]:
    names = [exact_name(m, s) for s in sizes(rows, cols) for m in spatial_models()]
    names += [refusal_name(op) for op in functional_ops()] + [LOSS]
    return names + fuzz_case_names(rows, cols, fuzz, seed)


def check_refusal(ctx: Context, grid: TileGrid, op_name: str) -> str:
    """The op must raise ConfigError naming the module and the op; if it does not, report how
    wrong the silent result is."""
    op, shown = functional_ops()[op_name]
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), FunctionalOp(op)).double()
    x = torch.randn(2, 3, 24, 20, dtype=torch.float64)
    net = spatialize(copy.deepcopy(model), grid, ctx)
    try:
        tile = scatter_tiles(x.clone().requires_grad_(True), grid, ctx)
        y = gather_tiles(net(tile), grid, ctx, full_shape=(2, 3, 24, 20))
    except ConfigError as error:
        text = str(error)
        assert "'1' (FunctionalOp)" in text and shown in text, text
        return f"ConfigError: {text[:90]}..."
    x_ref = x.clone().requires_grad_(True)
    y_ref = model(x_ref)
    x_sp = x.clone().requires_grad_(True)
    y = gather_tiles(spatialize(copy.deepcopy(model), grid, ctx)(scatter_tiles(x_sp, grid, ctx)),
                     grid, ctx, full_shape=y_ref.shape)
    grad = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (y_ref * grad).sum().backward()
    (y * grad).sum().backward()
    raise AssertionError(f"{op_name}: no ConfigError; output rel err "
                         f"{relative_error(y, y_ref):.2e}, input grad rel err "
                         f"{relative_error(x_sp.grad, x_ref.grad):.2e}")


def check_pixel_loss(ctx: Context, grid: TileGrid) -> str:
    """U-Net segmentation: tile_mean of per-pixel cross entropy == serial mean cross entropy."""
    from mpi4dl_nb.loss import tile_mean

    model = Sequence(unet_layers(seed=5)).double()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 32, 24, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 3, (2, 32, 24), generator=gen)
    reference = copy.deepcopy(model)
    x_ref = x.clone().requires_grad_(True)
    loss_ref = F.cross_entropy(reference(x_ref), target)
    loss_ref.backward()
    net = spatialize(model, grid, ctx)
    x_sp = x.clone().requires_grad_(True)
    out = net(scatter_tiles(x_sp, grid, ctx))
    loss = tile_mean(F.cross_entropy(out, scatter_tiles(target, grid, ctx), reduction="none"), net)
    loss.backward()
    reduce_tile_gradients(net)
    worst = relative_error(loss.detach(), loss_ref.detach())
    worst = max(worst, relative_error(x_sp.grad, x_ref.grad))
    ref = dict(reference.named_parameters())
    for name, p in net.named_parameters():
        err = relative_error(p.grad, ref[name].grad)
        assert err <= RTOL, f"{name} grad rel err {err:.2e}"
        worst = max(worst, err)
    assert worst <= RTOL, f"loss/input grad rel err {worst:.2e}"
    return f"worst rel err {worst:.2e}"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    positional = [a for a in sys.argv[1:] if not a.startswith("--")]
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    rows, cols = int(positional[0]), int(positional[1])
    fuzz = int(options.get("fuzz", 0))
    seed = int(options["seed"]) if "seed" in options else None
    only = set(options["only"].split(",")) if "only" in options else None
    ctx = Context(backend=options.get("backend", "mpi"))   # --backend=gloo: the torch plane
    grid = TileGrid(rows, cols)
    assert ctx.world_size == grid.num_tiles, "run with rows*cols ranks"
    if seed is None:
        for size in sizes(rows, cols):
            for index, (name, build) in enumerate(spatial_models().items()):
                if only and name not in only:
                    continue
                with check(exact_name(name, size)) as result:
                    torch.manual_seed(200 + index)
                    model = build().double()
                    x = torch.randn(2, 3, *size, dtype=torch.float64)
                    errors = check_spatial_exact(model, grid, x, ctx, what=exact_name(name, size),
                                                 rtol=RTOL, grad_floor=1e-2)
                    result.detail = f"worst rel err {max(errors.values()):.2e}"
        for op in functional_ops():
            if only and op not in only:
                continue
            with check(refusal_name(op)) as result:
                result.detail = check_refusal(ctx, grid, op)
        if not only or "loss" in only:
            with check(LOSS) as result:
                result.detail = check_pixel_loss(ctx, grid)
    for name, case_seed in zip(fuzz_case_names(rows, cols, fuzz, seed),
                               _seeds(rows, cols, fuzz, seed)):
        with check(name) as result:
            result.detail = run_fuzz_case(ctx, grid, case_seed, replay=_replay(rows, cols, case_seed))
    ctx.barrier()


def _seeds(rows: int, cols: int, count: int, seed: int | None) -> list[int]:
    from tests.support.fuzz import case_seeds

    return case_seeds(rows, cols, count, seed)


def _replay(rows: int, cols: int, seed: int) -> str:
    return (f"mpiexec -n {rows * cols} python -m mpi4py -m tests.mpi.spatial_correctness "
            f"{rows} {cols} --seed={seed} --fuzz=1")


if __name__ == "__main__":
    run_checks(main)
