"""MPI (3 ranks): a training step reads no tensor value into Python per action, for every schedule.

Usage: python -m tests.mpi.step_host_reads [--backend=gloo] [CASE ...] (default: every case).

Each case (a schedule: gpipe, 1f1b, interleaved, zb1, zbv, and GEMS) trains a float64 ResNet with a spatial
first stage (2 tiles: halo exchanges, BatchNorm sums over the tiles, gradient buckets on the tile group) and
pipelined layer stages (payloads between ranks; recomputation in the interleaved case) for one step under
``HostReads`` (tests/support/host_reads.py), which records every read of a tensor value into Python on every
rank. On a GPU each one waits for the kernels queued before it, so none may come per action (forward, backward,
send, receive, all-reduce, optimizer). The step is the engine's first: its one-off work (global sizes learnt,
payload headers encoded, buffers made) reads nothing either, so no warm-up step is needed.

The rule: the one read allowed is the step's loss, which ``train_step`` returns to the caller as a float (once
per step, after the last action); it must be seen exactly once, which also shows the recording was on.
Everything else, on every rank, fails the case with the reads and their call sites.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import mpi4dl_nb as dl
from tests.support.checks import Checks, run_checks
from tests.support.host_reads import Allowed, HostReads
from tests.support.models import build, labels
from tests.support.planes import split_backend

LOSS_READ = Allowed("pipeline/engine.py", "finish_step", "the step's loss returned to the caller: once per step",
                    most=1)
SPATIAL = dict(spatial_size=1, num_spatial_parts=2, slice_method="vertical")
CASES: dict[str, dict[str, object]] = {   # 3 ranks each: 2 tiles of stage 0, the other stages on the third
    "gpipe": dict(split_size=2, parts=2, schedule="gpipe", balance=(2, 3)),
    "1f1b": dict(split_size=2, parts=2, schedule="1f1b", balance=(2, 3)),
    "interleaved": dict(split_size=4, parts=2, schedule="interleaved", virtual_stages=2, balance=(2, 1, 1, 1),
                        checkpoint_activations="every"),
    "zb1": dict(split_size=2, parts=2, schedule="zb1", balance=(2, 3)),
    "zbv": dict(split_size=4, parts=2, schedule="zbv", balance=(2, 1, 1, 1)),
    "gems": dict(split_size=2, parts=2, times=1, balance=(2, 3)),
}   # balances given: the default cut's memory probe would import much of torch's reference ops first
IMAGE = 16


def check_name(case: str) -> str:
    return f"{case}: no host read per action"


def run_case(ctx: dl.Context, case: str) -> str:
    cfg = dl.ParallelConfig(**SPATIAL, **CASES[case])
    engine = dl.HybridEngine(build("resnet"), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(cfg.batch_divisor, 3, IMAGE, IMAGE, generator=generator, dtype=torch.float64)
    targets = labels("resnet", cfg.batch_divisor, IMAGE, generator)
    actions = len(engine.runtime.order)
    with HostReads() as reads:
        loss = engine.train_step(images, targets)
    found = reads.unexpected([LOSS_READ])
    assert not found, f"rank {ctx.rank}, {actions} actions: " + "; ".join(found)
    seen = sum(n for read, n in reads.reads.items() if LOSS_READ.covers(read))
    assert seen == 1, f"the step's loss was read {seen} times (recording off?)"
    assert actions > 0 and loss == loss, f"rank {ctx.rank} ran {actions} actions, loss {loss}"
    return f"{actions} actions, 1 read (the loss {loss:.6f})"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, names = split_backend(sys.argv[1:])
    ctx = dl.init(backend=backend)
    for case in names or list(CASES):
        with check(check_name(case)) as result:
            result.detail = run_case(ctx, case)


if __name__ == "__main__":
    run_checks(main)
