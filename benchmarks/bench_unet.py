"""U-Net segmentation on 4 tiles against one process: per-rank activation memory and step time, in one run.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 OMP_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 \\
        mpiexec -n 4 python benchmarks/bench_unet.py --size 1024

One SGD step of a U-Net (``models/unet.py``: depth 4, width 16, BatchNorm, bilinear up-sampling, 3
classes; ``ce+dice`` loss; batch 1; float32) trained two ways, side by side, steps in turns (``in_turns``:
each round one step of each, a barrier around each, the medians reported):

* ``4 tiles``: every stage spatial on a 2x2 grid (``split_size = spatial_size = 1``), the loss computed on
  the tiles (``DenseLoss.on_tiles``), nothing gathered; each rank holds its tile of the image and mask;
* ``one process``: the same model (same initial weights) on rank 0 while the other ranks wait.

Memory: the activation peak of a step, counted as the training loop counts it (``ActivationMeter``: the
tensors autograd saves, each storage once; RSS is not used, the tuned allocator keeps freed memory),
for each rank of the 4-tile run and for the one process; ratio = rank / one process (ideal 0.25).
Time: median wall seconds per step. Four ranks share the machine's cores, so the speed-up is bounded by
the core count, not by 4. Both runs train the same model on the same batch step after step: their
losses must agree (float32 sums in another order: to ~1e-5), printed as a check.

1024 px is the largest side that fits beside the one-process run on this project's 23 GB machine: at
2048 px the four processes (the one-process step's rank included) held ~18 GB and the machine ran out.
"""

from __future__ import annotations

import argparse
import copy

import torch
from support.machine import Footer
from support.tables import Table
from support.timing import in_turns
from support.world import require_world
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.loss import DenseLoss
from mpi4dl_nb.measure.usage import ActivationMeter
from mpi4dl_nb.models.unet import unet

MB = 2 ** 20


def batch(size: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image and its mask: blocks of each class with noise in the image (same on every rank)."""
    gen = torch.Generator().manual_seed(0)
    cells = torch.randint(0, classes, (1, 8, 8), generator=gen)
    mask = cells.repeat_interleave(size // 8, 1).repeat_interleave(size // 8, 2)
    image = mask.unsqueeze(1).expand(1, 3, size, size).float() / classes + 0.3 * torch.rand(1, 3, size, size,
                                                                                            generator=gen)
    return image, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="image side (a multiple of 2**depth)")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after one warm-up round")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()
    footer = Footer()
    ctx = dl.init()
    require_world(ctx, 4, "bench_unet")
    torch.manual_seed(0)
    layers = unet(args.depth, args.width, args.classes)
    serial = nn.Sequential(*copy.deepcopy(layers)) if ctx.rank == 0 else None
    loss = DenseLoss("ce+dice")
    cfg = dl.ParallelConfig(split_size=1, spatial_size=1, num_spatial_parts=4)
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=loss, image_size=args.size,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
    image, mask = batch(args.size, args.classes)
    tiled_meter, serial_meter = ActivationMeter(), ActivationMeter()
    losses: dict[str, list[float]] = {"4 tiles": [], "one process": []}

    def tiles() -> None:
        with tiled_meter:
            losses["4 tiles"].append(engine.train_step(image, mask))

    one_process = None
    if serial is not None:
        optimizer = torch.optim.SGD(serial.parameters(), lr=0.01)

        def one_process() -> None:
            optimizer.zero_grad(set_to_none=True)
            with serial_meter:
                value = loss(serial(image), mask)
                value.backward()
            optimizer.step()
            losses["one process"].append(float(value.detach()))

    seconds = in_turns(ctx, {"4 tiles": tiles, "one process": one_process}, args.rounds)
    peaks = ctx.all_gather_object(tiled_meter.peak)
    if ctx.rank != 0:
        return
    alone = serial_meter.peak
    table = Table(["run", "rank", ">activation peak MB", ">ratio to one process", ">step s", ">speed-up"])
    table.add("one process", 0, f"{alone / MB:.1f}", "1.00", f"{seconds['one process']:.2f}", "1.00")
    for rank, peak in enumerate(peaks):
        table.add("4 tiles (2x2)", rank, f"{peak / MB:.1f}", f"{peak / alone:.3f}",
                  f"{seconds['4 tiles']:.2f}" if rank == 0 else "", f"{seconds['one process'] / seconds['4 tiles']:.2f}"
                  if rank == 0 else "")
    print(f"U-Net depth {args.depth} width {args.width}, {args.classes} classes, {args.size}x{args.size} px, batch 1, "
          f"float32, ce+dice; {args.rounds} timed rounds (medians)\n")
    print(table.text(args.markdown))
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses["4 tiles"], losses["one process"]))
    print(f"\nlosses, 4 tiles: {[round(v, 5) for v in losses['4 tiles']]}; one process: "
          f"{[round(v, 5) for v in losses['one process']]} (largest relative gap {gap:.1e})")
    footer.print()


if __name__ == "__main__":
    main()
