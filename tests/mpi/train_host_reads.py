"""MPI (3 ranks): the ``train`` command reads as many tensor values into Python per step for a ResNet-8 as for a
ResNet-20, at most ``MOST_PER_STEP`` on a rank.

Usage: python -m tests.mpi.train_host_reads DEPTH [DEPTH ...] (ResNet depths, e.g. 8 20).

Each depth runs ``train`` (float64, 2 tiles of a spatial first stage + a layer rank, ``STEPS`` steps) in this
process under ``HostReads`` (tests/support/host_reads.py), and counts the reads a GPU would sync on that the
package's own files call (``item``, ``tolist``, ``bool``, ``float``, ``int``: the caller's frame in
``mpi4dl_nb/``), per training step (``Trainer.train_one``) and over the whole command. Each rank reports its
per-step counts; the test compares them across depths. A read per parameter or per layer shows as a count that
grows with the depth.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from mpi4dl_nb.cli import train_cmd
from mpi4dl_nb.run.trainer import Trainer
from tests.support.checks import Checks, run_checks
from tests.support.host_reads import PACKAGE, HostReads, Read

COUNTED = {f"Tensor.{name}" for name in ("item", "tolist", "__bool__", "__float__", "__int__")}
MOST_PER_STEP = 6
STEPS = 3
FLAGS = ("--model", "resnet", "--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "2",
         "--slice-method", "vertical", "--batch-size", "2", "--image-size", "16", "--num-samples", "8",
         "--dtype", "float64", "--steps", str(STEPS), "--no-progress", "--read-ahead", "0")


def check_name(depth: int) -> str:
    return f"resnet-{depth}: reads per step"


def counted(read: Read) -> bool:
    """A read the package's own file called (the innermost frame is the package's)."""
    return read.op in COUNTED and Path(read.made_in.rsplit(":", 1)[0]).is_relative_to(PACKAGE)


def package_reads(reads: HostReads) -> int:
    return sum(n for read, n in reads.reads.items() if counted(read))


def per_step(reads: HostReads) -> tuple[list[int], Callable[[], None]]:
    """The package's reads of every ``Trainer.train_one`` from now on, and the call that stops counting them."""
    steps: list[int] = []
    original = Trainer.train_one

    def train_one(self: Trainer) -> float:
        before = package_reads(reads)
        loss = original(self)
        steps.append(package_reads(reads) - before)
        return loss

    Trainer.train_one = train_one  # type: ignore[method-assign]

    def restore() -> None:
        Trainer.train_one = original  # type: ignore[method-assign]
    return steps, restore


def run_depth(depth: int) -> str:
    with HostReads() as reads:
        steps, restore = per_step(reads)
        try:
            code = train_cmd.main([*FLAGS, "--num-layers", str(depth)])
        finally:
            restore()
    assert code == 0, f"train exited {code}"
    assert len(steps) == STEPS, f"{len(steps)} steps counted"
    sites = sorted(f"{n} x {read}" for read, n in reads.reads.items() if counted(read))
    assert max(steps) <= MOST_PER_STEP, f"reads per step {steps}: " + "; ".join(sites)
    return f"steps={','.join(map(str, steps))} total={package_reads(reads)} | " + "; ".join(sites)


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    for depth in map(int, sys.argv[1:]):
        with check(check_name(depth)) as result:
            result.detail = run_depth(depth)


if __name__ == "__main__":
    run_checks(main)
