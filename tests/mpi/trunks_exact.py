"""Feature trunks of torchvision and timm CNNs on 2x2 tiles equal one process (issue 34's acceptance).

Float64, seeded random weights (``initialized``: no library init, no download), batch 2 at 64 x 64, in
training mode (BatchNorm batch statistics, stochastic depth drawn from one random state): output, input
gradient, every parameter gradient, every buffer, then an eval forward. The serial reference of model i
runs on rank i mod 4 alone; every rank checks that its gradients and buffers equal the others'.
torchvision's DeepLabV3 (MobileNetV3 backbone) runs whole: dropout in the head, the ASPP pooling branch
resampled to a tile's size, the output resampled to the input's size.

Usage: python -m tests.mpi.trunks_exact
Named checks: ``check_names()``.
"""

from __future__ import annotations

import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.checks import Checks, run_checks
from tests.support.exactness import SAME_ON_EVERY_RANK, check_spatial_exact
from tests.support.spatial_models import TRUNKS, initialized

# float64 roundoff of tiled summation orders, amplified by BatchNorm over the 2x2 maps of batch 2
# through 50+ layers; a real error (a wrong halo, statistics of one tile) is many orders larger
RTOL = 1e-8
IMAGE = 64


def check_name(model: str) -> str:
    return f"{model} equals one process"


def check_names() -> list[str]:
    return [check_name(model) for model in TRUNKS]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
    grid = TileGrid(2, 2)
    assert ctx.world_size == grid.num_tiles, "run with 4 ranks"
    for index, (name, build) in enumerate(TRUNKS.items()):
        with check(check_name(name)) as result:
            model = initialized(build, seed=index)
            torch.manual_seed(index)
            x = torch.randn(2, 3, IMAGE, IMAGE, dtype=torch.float64)
            errors = check_spatial_exact(model, grid, x, ctx, what=name, rtol=RTOL, grad_floor=1e-3,
                                         forward_seed=1000 + index, reference_rank=index % ctx.world_size)
            compared = {k: v for k, v in errors.items() if k != SAME_ON_EVERY_RANK}
            result.detail = (f"worst rel err {max(compared.values()):.2e} over {len(compared)} tensors"
                             if compared else "tiles only (compared on another rank)")
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
