"""The op families of torchvision/timm CNNs on tiles (issue 34): each handler exact against one process in
float64 (outputs, input gradient, every parameter gradient, BatchNorm buffers, an eval forward), what stays
refused named with its module and op, and random draws refused when the tiles' random states differ.

Usage: python -m tests.mpi.spatial_families ROWS COLS
Named checks: ``check_names()``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import gather_tiles, scatter_tiles
from tests.support.checks import Checks, run_checks
from tests.support.exactness import check_spatial_exact
from tests.support.spatial_models import family_models

RTOL = 1e-10
SIZE = (26, 30)        # uneven tiles on every grid; 13x15 after a stride-2 layer
RANDOM_STATES = "refuses random draws when the tiles' random states differ"
OWN_ERROR = "a model's own error on a tile names the module and the way out"

Op = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Custom(nn.Module):
    """A conv child, then ``op`` in the custom forward."""

    def __init__(self, op: Op) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self, x)


# name -> (op, what the refusal must name)
REFUSED: dict[str, tuple[Op, str]] = {
    "mean over one image axis": (lambda m, y: y * y.mean(2, keepdim=True), "Tensor.mean"),
    "F.linear over the width": (lambda m, y: F.linear(y, torch.ones(y.shape[-1], y.shape[-1]).double()),
                                "F.linear"),
    "alpha_dropout": (lambda m, y: F.alpha_dropout(y, 0.5, training=True), "F.alpha_dropout"),
    "rand_like on a tile": (lambda m, y: y * torch.rand_like(y), "torch.rand_like"),
    "rrelu in training": (lambda m, y: F.rrelu(y, training=True), "F.rrelu"),
    "interpolate to a computed size": (
        lambda m, y: F.interpolate(y, size=(y.shape[-2] * 2, y.shape[-1] * 2)), "F.interpolate"),
    "a conv on a transposed tile": (lambda m, y: m.conv(y.permute(0, 1, 3, 2)), "layer '1.conv'"),
    "a view mixing a channels-last tile": (   # columns with channels; (N, H * W, C) would be exact
        lambda m, y: y.permute(0, 2, 3, 1).reshape(y.shape[0], y.shape[2], -1).mean(1)[..., None] * y,
        "Tensor.reshape"),
    "indexing a channels-last tile": (lambda m, y: y.permute(0, 2, 3, 1)[:, 1:].sum() * y,
                                      "Tensor.__getitem__"),
    "adaptive_avg_pool2d to 2x2": (lambda m, y: F.adaptive_avg_pool2d(y, 2).mean() * y,
                                   "F.adaptive_avg_pool2d"),
}


def image_sized(m: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """A model's own check of its input's size (timm's BoTNet asserts its position embedding's)."""
    assert y.shape[-2:] == SIZE
    return m.conv(y)


def exact_name(model: str) -> str:
    return f"{model} exact"


def refusal_name(case: str) -> str:
    return f"refuses {case}"


def check_names() -> list[str]:
    return [*map(exact_name, family_models()), *map(refusal_name, REFUSED), RANDOM_STATES, OWN_ERROR]


def check_refused(ctx: Context, grid: TileGrid, case: str) -> str:
    op, shown = REFUSED[case]
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Custom(op)).double()
    x = torch.randn(2, 3, *SIZE, dtype=torch.float64)
    try:
        net = spatialize(copy.deepcopy(model), grid, ctx)
        gather_tiles(net(scatter_tiles(x, grid, ctx)), grid, ctx)
    except ConfigError as error:
        text = str(error)
        assert shown in text and ("(Custom)" in text or "(Conv2d)" in text), text
        return f"ConfigError: {text[:100]}..."
    raise AssertionError(f"{case}: no ConfigError")


def check_random_states(ctx: Context, grid: TileGrid) -> str:
    torch.manual_seed(4)
    model = family_models()["dropout on tiles (nn.Dropout, dropout2d, pooled)"]().double()
    x = torch.randn(2, 3, *SIZE, dtype=torch.float64)
    net = spatialize(model, grid, ctx)
    torch.manual_seed(100 + ctx.rank)     # a different random state on every rank
    try:
        net(scatter_tiles(x, grid, ctx))
    except ConfigError as error:
        assert "random states" in str(error) and "F.dropout" in str(error), str(error)
        return f"ConfigError: {str(error)[:100]}..."
    raise AssertionError("no ConfigError")


def check_own_error(ctx: Context, grid: TileGrid) -> str:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Custom(image_sized)).double()
    x = torch.randn(2, 3, *SIZE, dtype=torch.float64)
    assert model(x).shape[-2:] == SIZE   # one process: the check holds
    net = spatialize(model, grid, ctx)
    tile = scatter_tiles(x, grid, ctx)
    try:
        raise KeyError("a caller's own error, being handled while the model runs")
    except KeyError as handled:
        try:
            net(tile)
        except AssertionError as error:
            notes = getattr(error, "__notes__", [])
            assert len(notes) == 1 and "layer '1' (Custom)" in notes[0] and "--balance" in notes[0], notes
            assert not hasattr(handled, "__notes__"), handled.__notes__
            try:   # an error of this package's own code keeps no note (a tile of the wrong size)
                spatialize(model, grid, ctx, image_size=(2 * SIZE[0], 2 * SIZE[1]))(tile)
            except ValueError as own:
                assert not hasattr(own, "__notes__"), own.__notes__
                return f"note: {notes[0][:100]}..."
            raise AssertionError("no ValueError for a tile of the wrong size") from None
    raise AssertionError("no AssertionError")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    rows, cols = (int(a) for a in sys.argv[1:3])
    ctx = Context()
    grid = TileGrid(rows, cols)
    assert ctx.world_size == grid.num_tiles, "run with rows*cols ranks"
    for index, (name, build) in enumerate(family_models().items()):
        with check(exact_name(name)) as result:
            torch.manual_seed(500 + index)
            model = build().double()
            x = torch.randn(2, 3, *SIZE, dtype=torch.float64)
            errors = check_spatial_exact(model, grid, x, ctx, what=name, rtol=RTOL, grad_floor=1e-2,
                                         forward_seed=77)
            result.detail = f"worst rel err {max(errors.values()):.2e}"
    for case in REFUSED:
        with check(refusal_name(case)) as result:
            result.detail = check_refused(ctx, grid, case)
    with check(RANDOM_STATES) as result:
        result.detail = check_random_states(ctx, grid)
    with check(OWN_ERROR) as result:
        result.detail = check_own_error(ctx, grid)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
