"""MPI: the gradient all-reduce overlapped with backward (grad_bucket_mb) == the all-reduce after all backwards.

Usage: python -m tests.mpi.grad_overlap [--backend=gloo] CASE [CASE ...] (engine cases of this world size,
tests/support/engine_cases.py). Named checks per CASE:

* ``<CASE> same as after backward``: 3 SGD-momentum steps (float64) with small buckets
  (``TINY_MB``: several buckets per stage) give every loss and every rank's state within 1e-12
  (relative, as engine_exact) of the same run with ``grad_bucket_mb=None``;
* ``<CASE> posted during backward`` (issue 44's acceptance line): in the last step's trace, every
  stage this rank shares with other holders posted its buckets in order, the first of them before
  the backward of the stage's first layer finished (a hook on that layer's first parameter stamps
  when its gradient of the step's last backward arrived) and before the last backward action ended;
  none was posted before the last backward action began (the counting of backward passes).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.trace import Event
from tests.mpi.engine_exact import batches, sgd, state_error
from tests.support.checks import Checks, run_checks
from tests.support.engine_cases import CASES
from tests.support.models import build

TINY_MB = 0.002   # ~2 KB: a handful of buckets per stage of the tests' small models
RTOL = 1e-12


def train(ctx, name: str, bucket_mb: float | None, stamps: dict[int, list[float]] | None = None):
    kwargs, model_name, batch, image = CASES[name]
    cfg = dl.ParallelConfig(**{**kwargs, "grad_bucket_mb": bucket_mb})
    engine = dl.HybridEngine(build(model_name), cfg, ctx, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    if stamps is not None:   # when the first layer of each held stage got a gradient
        for inst in engine.instances.values():
            first = next(p for p in inst.module.parameters() if p.requires_grad)
            times = stamps.setdefault(inst.stage, [])
            first.register_post_accumulate_grad_hook(lambda _p, times=times: times.append(ctx.tracer.now()))
    losses = [engine.train_step(x, y) for x, y in batches(model_name, batch, image, seed=len(name))]
    states = {(inst.replica, inst.stage): inst.canonical.full_state_dict() for inst in engine.instances.values()}
    return engine, losses, states


def check_same(ctx, name: str) -> str:
    _, base_losses, base = train(ctx, name, None)
    _, losses, states = train(ctx, name, TINY_MB)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, base_losses))
    if worst > RTOL:
        raise AssertionError(f"{name}: losses {losses} != after-backward {base_losses}")
    for key, want in base.items():
        worst = max(worst, state_error(states[key], want, f"{name} copy {key}", RTOL))
    return f"max rel err {worst:.2e}"


def check_posted(ctx, name: str) -> str:
    stamps: dict[int, list[float]] = {}
    engine, _, _ = train(ctx, name, TINY_MB, stamps)
    reducer = engine.runtime.reducer
    assert reducer is not None
    step = [e for e in ctx.tracer.events if e.start >= _last_step_start(ctx.tracer.events)]
    details = []
    for stage, buckets in sorted(reducer.stages.items()):
        posts = [e for e in step if e.op == "allreduce-post" and e.stage == stage]
        backwards = [e for e in step if e.op == "B" and e.stage == stage]
        if len(buckets.buckets) < 2:
            raise AssertionError(f"{name} stage {stage}: one bucket only; the check needs several")
        order = [e.extra["bucket"] for e in posts]
        if order != list(range(len(buckets.buckets))):
            raise AssertionError(f"{name} stage {stage}: buckets posted in order {order}")
        first_layer_done = max(s for s in stamps[stage] if s >= backwards[-1].start)
        last_backward = backwards[-1]
        if not posts[0].start < first_layer_done:
            raise AssertionError(f"{name} stage {stage}: the first all-reduce was posted at {posts[0].start:.6f}, "
                                 f"not before the first layer's backward finished ({first_layer_done:.6f})")
        if not posts[0].start < last_backward.end:
            raise AssertionError(f"{name} stage {stage}: first post after the last backward ended")
        early = [e for e in posts if e.start < last_backward.start]
        if early:
            raise AssertionError(f"{name} stage {stage}: {len(early)} buckets posted before the last backward")
        during = sum(1 for e in posts if e.start < last_backward.end)
        details.append(f"stage {stage}: {during}/{len(posts)} buckets posted during backward, the first "
                       f"{(first_layer_done - posts[0].start) * 1e3:.2f} ms before the first layer's gradient")
    return "; ".join(details)


def _last_step_start(events: list[Event]) -> float:
    """When the last step began: the end of the step before's optimizer action (one per step and rank)."""
    optimizer_ends = sorted(e.end for e in events if e.op == "OPTIM")
    return optimizer_ends[-2]


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    ctx = dl.init(backend=options.get("backend", "auto"))
    for name in names:
        with check(f"{name} same as after backward") as result:
            result.detail = check_same(ctx, name)
        with check(f"{name} posted during backward") as result:
            result.detail = check_posted(ctx, name)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
