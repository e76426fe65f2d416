"""Models nobody here wrote on 2x2 tiles + a layer rank against one process: activation memory per rank and step time.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 OMP_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1 \\
        mpiexec -n 5 python benchmarks/bench_byom.py --size 1024

torchvision's ResNet-50, ConvNeXt-T and EfficientNet-B0 (no weights, 2 classes; cut into pieces by
``models/cut.py`` as ``--model torchvision:NAME`` does), one after the other, each trained two ways side by
side, steps in turns (``in_turns``: each round one step of each, a barrier around each, medians reported):

* ``SP 2x2 + LP``: split 2, spatial 1, 4 tiles (ranks 0-3) and the layer rank (rank 4), the stage cut the
  engine makes for this image size (``pipeline.default_cut.default_balance``: memory per rank, halos fitting the
  tiles);
* ``one process``: the same model (same initial weights) on rank 0 while the other ranks wait.

Batch 1, float32, SGD with momentum. Memory: the activation peak of a step as the training loop counts it
(``measure.usage.ActivationMeter``: the tensors autograd saves, each storage once, parameters left out; RSS
is not used, the tuned allocator keeps freed memory), per rank of the parallel run and for the one process;
ratio = rank / one process (a tile of a stage that holds everything would be 0.25). Time: median wall
seconds per step; five ranks share this machine's cores, so the speed-up is bounded by the core count, not
by the ranks. Training draws random numbers (stochastic depth, dropout) in another order on the ranks, so
the two runs' losses are not compared here (exactness: the test suite, float64).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterable

import torch
from support.machine import Footer
from support.tables import Table
from support.timing import in_turns
from support.world import require_world
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.measure.usage import ActivationMeter
from mpi4dl_nb.models.spec import ModelSpec

MB = 2 ** 20
MODELS = ("torchvision:resnet50", "torchvision:convnext_tiny", "torchvision:efficientnet_b0")
CFG = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def compare(ctx: dl.Context, name: str, size: int, rounds: int) -> tuple[list[int], int, dict[str, float], str]:
    """Every rank's activation peak in SP 2x2 + LP, the one process's, the median seconds of each, the cut."""
    torch.manual_seed(0)
    layers = ModelSpec.of(name, num_classes=2).build(size)
    serial = nn.Sequential(*copy.deepcopy(layers)) if ctx.rank == 0 else None
    engine = dl.HybridEngine(layers, CFG, ctx, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, image_size=size)
    generator = torch.Generator().manual_seed(1)
    image, label = torch.randn(1, 3, size, size, generator=generator), torch.tensor([1])
    params = [p for inst in engine.instances.values() for p in inst.canonical.parameters()]
    tiled_meter = ActivationMeter(exclude=params)
    serial_meter = ActivationMeter(exclude=serial.parameters() if serial is not None else ())

    def parallel() -> None:
        torch.manual_seed(2)   # the tiles draw stochastic depth from one random state (rank 0 also ran serial)
        with tiled_meter:
            engine.train_step(image, label)

    one_process = None
    if serial is not None:
        optimizer, loss_fn = sgd(serial.parameters()), nn.CrossEntropyLoss()

        def one_process() -> None:
            optimizer.zero_grad(set_to_none=True)
            with serial_meter:
                loss_fn(serial(image), label).backward()
            optimizer.step()

    seconds = in_turns(ctx, {"parallel": parallel, "one process": one_process}, rounds)
    peaks = ctx.all_gather_object(tiled_meter.peak)
    cut = f"{len(layers)} pieces, balance {','.join(map(str, engine.balance))}"
    return peaks, serial_meter.peak, seconds, cut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="image side (a multiple of 32)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after one warm-up round")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model specs")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()
    footer = Footer()
    ctx = dl.init()
    require_world(ctx, CFG.world_size, "bench_byom")
    table = Table(["model", "run", "rank", ">activation peak MB", ">ratio to one process", ">step s", ">speed-up"])
    cuts = []
    for name in args.models.split(","):
        peaks, alone, seconds, cut = compare(ctx, name, args.size, args.rounds)
        cuts.append(f"{name}: {cut}")
        if ctx.rank != 0:
            continue
        print(f"{name} done: {cut}", flush=True)
        table.add(name, "one process", 0, f"{alone / MB:.1f}", "1.00", f"{seconds['one process']:.2f}", "1.00")
        for rank, peak in enumerate(peaks):
            role = f"tile {rank}" if rank < CFG.num_spatial_parts else "layer rank"
            first = rank == 0
            table.add(name, f"SP 2x2 + LP ({role})", rank, f"{peak / MB:.1f}", f"{peak / alone:.3f}",
                      f"{seconds['parallel']:.2f}" if first else "",
                      f"{seconds['one process'] / seconds['parallel']:.2f}" if first else "")
    if ctx.rank != 0:
        return
    print(f"\n{args.size}x{args.size} px, batch 1, float32, SGD momentum; {args.rounds} timed rounds (medians); "
          f"stage cuts: {'; '.join(cuts)}\n")
    print(table.text(args.markdown))
    footer.print()


if __name__ == "__main__":
    main()
