"""5 ranks: the default stage cut fits the tiles, and trains exactly like one process (float64).

MPI4DL's AmoebaNet example shape at a small image (3 layers, 16 filters, 128 px, split 2, spatial 1,
1x4 vertical tiles): the memory-optimal cut alone puts cells whose halo is wider than a 2-px tile
column on the spatial stage; ``HybridEngine(..., image_size=128)`` cuts where every spatial layer
fits, and two SGD-momentum steps give the losses and the state (weights, BatchNorm statistics) of
``serial_reference``. Named checks: ``CHECKS``.

Usage: python -m tests.mpi.tile_fit_exact
"""
from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.models import build_model
from mpi4dl_nb.pipeline.default_cut import default_balance
from mpi4dl_nb.pipeline.tile_fit import tile_reach
from tests.support.checks import Checks, run_checks
from tests.support.exactness import relative_error

RTOL = 1e-9
IMAGE = 128
CFG = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="vertical")
CUT, EXACT = "amoebanet cut fits 1x4 tiles at 128 px", "amoebanet 128 px on 1x4 tiles equals one process"
CHECKS = (CUT, EXACT)


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    torch.manual_seed(0)
    layers = [layer.double() for layer in build_model("amoebanet", num_layers=3, num_filters=16,
                                                         num_classes=10, image_size=IMAGE)]
    engine = dl.HybridEngine(copy.deepcopy(layers), CFG, ctx, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd,
                             image_size=IMAGE)
    with check(CUT) as result:
        reach = tile_reach(layers, CFG, IMAGE)
        assert reach is not None and reach.refusal is not None, "some cell of this model does not fit 2-px tiles"
        unchecked = default_balance(layers, CFG)
        assert unchecked[0] > reach.layers, f"the cut without image_size {unchecked} fits: no regression shown"
        assert engine.balance[0] <= reach.layers, f"{engine.balance} puts layer {reach.layers} on the tiles"
        result.detail = f"cut {engine.balance}, {reach.layers} layers fit; without the image size {unchecked}"
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(1, 3, IMAGE, IMAGE, generator=gen, dtype=torch.float64),
                torch.randint(0, 10, (1,), generator=gen)) for _ in range(2)]
    with check(EXACT) as result:
        losses = [engine.train_step(x, y) for x, y in batches]
        state = engine.full_state_dict()
        if ctx.rank == 0:
            serial = dl.serial_reference(CFG, layers, batches, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
            for step, (mine, theirs) in enumerate(zip(losses, serial.losses)):
                assert abs(mine - theirs) <= RTOL * abs(theirs), f"step {step} loss {mine} vs {theirs}"
            reference = serial.state_dict()
            assert set(state) == set(reference), f"state keys differ: {set(state) ^ set(reference)}"
            worst = max(relative_error(state[k].double(), v.double()) for k, v in reference.items())
            assert worst <= RTOL, f"state after 2 steps: relative error {worst:.2e}"
            result.detail = f"losses {losses}, worst state error {worst:.1e}"
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
