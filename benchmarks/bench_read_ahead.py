"""Input read ahead (issue 64): the per-step wait for input with ``--read-ahead 0`` and 1, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_read_ahead.py

One process trains a small float32 network on synthetic images whose every region read sleeps (a slide's region
read, stain normalisation and augmentation stand-in) and whose forward sleeps as long as the step's compute is
to last, for a few read/compute ratios. Each case runs ``--steps`` steps with the input read inside the step
(``read_ahead=0``) and on the worker thread one step ahead (``read_ahead=1``); a step's wait is what the trainer's
``input_wait_seconds`` gained during it, the median over the steps after the first (the first waits for its whole
read either way). Expected: inline, the wait is the read; read ahead, max(0, read - compute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from support.machine import Footer
from support.tables import Table
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.data import Batcher
from mpi4dl_nb.data.synthetic import SyntheticDataset
from mpi4dl_nb.run.trainer import Trainer, TrainSettings

IMAGE = 32
BATCH = 2


class SlowReads(SyntheticDataset):
    """Synthetic images, each region read taking ``seconds`` longer (a sleep: it releases the GIL, as I/O does)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(IMAGE, num_classes=2, num_samples=64)
        self.seconds = seconds

    def read(self, index: int, box: object = None) -> torch.Tensor:
        time.sleep(self.seconds)
        return super().read(index, box)   # type: ignore[arg-type]


class Compute(nn.Module):
    """Identity whose forward lasts ``seconds`` (the step's compute, with the GIL released as torch's kernels do)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def layers(compute: float) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(Compute(compute), nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))]


def step_waits(read: float, compute: float, read_ahead: int, steps: int) -> tuple[list[float], list[float]]:
    """Each step's wait for input and its whole time (seconds) with ``read`` seconds of reads per step."""
    engine = dl.HybridEngine(layers(compute), dl.ParallelConfig(split_size=1, spatial_size=0), dl.init(),
                             loss_fn=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    settings = TrainSettings(steps=steps, progress=False, read_ahead=read_ahead)
    trainer = Trainer(engine, Batcher(SlowReads(read / BATCH), BATCH, seed=0), engine.ctx, settings)
    waits: list[float] = []
    train_one = trainer.train_one

    def timed_step() -> float:
        before = trainer.reads.wait_seconds
        loss = train_one()
        waits.append(trainer.reads.wait_seconds - before)
        return loss
    trainer.train_one = timed_step          # type: ignore[method-assign]
    trainer.run()
    return waits, trainer.metrics.step_seconds


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute-ms", type=float, default=400.0, help="the compute of a step")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="read / compute per step")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    compute = args.compute_ms / 1000
    table = Table([">read / compute (set)", ">compute ms", ">wait ms, read-ahead 0 (= the read)",
                   ">wait ms, read-ahead 1", ">max(0, read - compute) ms", ">step ms, read-ahead 0", ">step ms, 1"])
    for ratio in args.ratios:
        read = ratio * compute
        inline, inline_steps = step_waits(read, compute, 0, args.steps)
        ahead, ahead_steps = step_waits(read, compute, 1, args.steps)
        measured = statistics.median(s - w for s, w in zip(inline_steps[1:], inline[1:]))   # the step less its wait
        reading = statistics.median(inline[1:])
        table.add(f"{ratio:g}", ms(measured), ms(reading), ms(statistics.median(ahead[1:])),
                  ms(max(0.0, reading - measured)), ms(statistics.median(inline_steps[1:])),
                  ms(statistics.median(ahead_steps[1:])))
    print(f"median per step over steps 2-{args.steps}, batch {BATCH} ({BATCH} region reads per step), "
          f"{IMAGE} px, 1 process")
    print(table.text(args.markdown))
    footer.print()


if __name__ == "__main__":
    main()
