"""Every spatial layer type and a ResNet-style stack: spatialize(model) on tiles == serial, float64.

Usage: python -m tests.mpi.spatial_exactness ROWS COLS [BACKEND [MODEL,MODEL...]]. Checks
image sizes 64x64, 96x96 and 100x120 (all exact on grids up to 3x3), then that impossible
sizes raise ConfigError. Named checks: ``check_names(ROWS, COLS, MODELS)``.
"""

from __future__ import annotations

import sys
import warnings

import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact
from tests.support.spatial_models import layer_models

SIZES = [(64, 64), (96, 96), (100, 120)]


def exact_name(model: str, height: int, width: int) -> str:
    return f"{model} {height}x{width}"


def refusals(rows: int, cols: int) -> list[tuple[str, tuple[int, int]]]:
    """(model, image size) that cannot be exact on this grid, so must be refused."""
    cases = []
    for name, size in (("resnet_stack", (2 * rows, 2 * cols)),   # a stage would own 0 rows
                       ("big_kernel", (3 * rows, 3 * cols))):     # halo wider than a tile
        if rows * cols == 1 or (name == "big_kernel" and max(rows, cols) < 3):
            continue   # with < 3 parts the neighbour holds the whole remaining axis
        cases.append((name, size))
    return cases


def refusal_name(model: str, size: tuple[int, int]) -> str:
    return f"refuses {model} at {size[0]}x{size[1]}"


def check_names(rows: int, cols: int, models: list[str] | None = None) -> list[str]:
    """Every check the program reports on a ``rows x cols`` grid (``models``: only these)."""
    return [exact_name(name, height, width) for height, width in SIZES for name in layer_models()
            if not models or name in models] + \
        [refusal_name(name, size) for name, size in refusals(rows, cols)]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Using padding='same'")
    rows, cols = int(sys.argv[1]), int(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "mpi"
    models = sys.argv[4].split(",") if len(sys.argv) > 4 else None
    ctx = Context(backend=backend)
    grid = TileGrid(rows, cols)
    assert ctx.world_size == grid.num_tiles, "run with rows*cols ranks"
    builders = layer_models()
    for height, width in SIZES:
        for index, (name, build) in enumerate(builders.items()):
            if models and name not in models:
                continue
            with check(exact_name(name, height, width)) as result:
                torch.manual_seed(100 + index)
                model = build().double()
                x = torch.randn(2, 3, height, width, dtype=torch.float64)
                errors = check_spatial_exact(model, grid, x, ctx, what=f"{name} {height}x{width}")
                result.detail = f"worst rel err {max(errors.values()):.2e}"
    # configurations that cannot be exact are refused up front, naming the knob
    for name, size in refusals(rows, cols):
        with check(refusal_name(name, size)):
            torch.manual_seed(7)
            model = (layer_models()["resnet_stack"]() if name == "resnet_stack"
                     else torch.nn.Conv2d(3, 2, 9, padding=4)).double().to(ctx.device)
            x = torch.randn(1, 3, *size, dtype=torch.float64).to(ctx.device)
            net = spatialize(model, grid, ctx)
            try:
                net(scatter_tiles(x, grid, ctx))
            except ConfigError as error:
                assert error.knob in ("num_spatial_parts", "image_size", "slice_method"), error.knob
                assert "use" in str(error), str(error)
            else:
                raise AssertionError(f"{name} at {size} on {grid} should raise ConfigError")
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
