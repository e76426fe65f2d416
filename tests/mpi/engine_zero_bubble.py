"""MPI (2 or 5 ranks): the zero-bubble schedule's split backward on the ranks: memory, work moved to W.

Usage: mpiexec -n 2|5 python -m tests.mpi.engine_zero_bubble (2 ranks: all but the spatial check; 5: that one)

Named checks:

* ``zb1 activation peak``: S=2, m=4, float64 ResNet on 32x32 images, one step with 1F1B and one
  with zb1: the counted activation peak (ActivationMeter: bytes saved for backward) of rank 0
  (stage 0, which holds 1F1B's peak number of micro-batches in both) with zb1 is at most 1.05x its
  1F1B peak, and the pipeline's peak (the larger rank's) at most 1.05x 1F1B's; the detail gives
  every rank's figures (stage 1 holds up to S micro-batches with zb1, S-1 with 1F1B).
* ``zbv activation peak``: 8 equal float64 conv-BN-ReLU layers and a head on 16x16 images, m=4: zbv on
  2 ranks (4 stages of 2 layers, rank r holding stages r and 3-r) against 1F1B on 2 ranks (2 stages of
  4 layers): every rank's zbv peak is at most 1F1B's stage-0 peak (2S chunk activations of half a stage
  = S stage activations: balanced memory) plus one micro-batch's received stage input (rank 0's up
  chunk keeps the input it received, a buffer of its own; 1F1B's stage 0 receives nothing) and 1 KiB
  (the head's and loss's saved tensors, also on rank 0's up chunk), and 1F1B's stage 1 is below that
  peak (unbalanced).
* ``zb1 W does the weight work``: on rank 1 (stage 1), after micro-batch 0's I no parameter has a
  gradient, after its W every one has (the split is real, not a whole backward in I); on rank 0 the
  first stage is not split (``split_backward.splits_backward``): every parameter has its gradient after I.
* ``zb1 spatial W exchanges nothing``: two SP stages (2 tiles each) + LP, zb1, m=3, 5 ranks: on the
  tile ranks of stage 1 (split) the W actions make no exchange and no all-reduce (calls counted on the
  rank's Comm), the I actions do (the halo returns, the tile BatchNorms' sums), and W gives the stage's
  parameters their gradients; on stage 0's tile ranks (not split) I does all of it, W nothing.
"""

from __future__ import annotations

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.measure.usage import ActivationMeter
from mpi4dl_nb.pipeline.actions import Action, ActionKind
from tests.mpi.engine_exact import batches, sgd
from tests.support.checks import Checks, run_checks
from tests.support.models import build

KNOBS = dict(split_size=2, spatial_size=0, parts=4)
SLACK = 1.05
IN, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def peak(ctx, schedule: str) -> tuple[int, dl.HybridEngine]:
    layers = build("resnet")
    meter = ActivationMeter(exclude=[p for layer in layers for p in layer.parameters()])
    engine = dl.HybridEngine(layers, dl.ParallelConfig(**KNOBS, schedule=schedule), ctx,
                             loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    (x, y), = batches("resnet", 8, 32, seed=4)[:1]
    with meter:
        engine.train_step(x, y)
    return meter.peak, engine


class MeanHead(nn.Module):
    """Spatial mean then a Linear: saves next to nothing for backward (a pool layer would save its input)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.linear = nn.Linear(channels, 5, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.mean(dim=(2, 3)))


def equal_layers(depth: int = 8, channels: int = 4) -> list[nn.Module]:
    """``depth`` equal conv-BN-ReLU layers (equal activations per layer) and a head holding next to nothing."""
    torch.manual_seed(0)
    body = [nn.Sequential(nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1, dtype=torch.float64),
                          nn.BatchNorm2d(channels, dtype=torch.float64), nn.ReLU()) for i in range(depth)]
    return [*body, MeanHead(channels)]


def equal_layers_peak(ctx, **knobs) -> int:
    layers = equal_layers()
    meter = ActivationMeter(exclude=[p for layer in layers for p in layer.parameters()])
    engine = dl.HybridEngine(layers, dl.ParallelConfig(spatial_size=0, parts=4, **knobs), ctx,
                             loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    (x, y), = batches("resnet", 8, 16, seed=4)[:1]
    with meter:
        engine.train_step(x, y)
    return meter.peak


def check_zbv_peak(ctx) -> str:
    mine = {"1f1b": equal_layers_peak(ctx, split_size=2, schedule="1f1b", balance=(4, 5)),
            "zbv": equal_layers_peak(ctx, split_size=4, schedule="zbv", balance=(2, 2, 2, 3))}
    every = ctx.all_gather_object(mine)
    first = every[0]["1f1b"]
    # one micro-batch's stage input (2 samples x 4 ch x 16 x 16 float64) and the head's and loss's few saved bytes
    received = (8 // 4) * 4 * 16 * 16 * 8 + 1024
    detail = "; ".join(f"rank {r}: 1f1b {p['1f1b'] / 2**10:.0f} KiB, zbv {p['zbv'] / 2**10:.0f} KiB"
                       for r, p in enumerate(every)) + f"; allowance {received / 2**10:.0f} KiB"
    worst = max(r["zbv"] for r in every)
    if worst > first + received or not every[1]["1f1b"] < first:
        raise AssertionError(f"zbv's largest rank peak {worst} B > 1F1B's stage 0 {first} B + {received} B ({detail})")
    return f"{detail}; zbv's largest {worst / first:.3f}x 1F1B's stage 0"


def check_peak(ctx) -> str:
    mine = {kind: peak(ctx, kind)[0] for kind in ("1f1b", "zb1")}
    every = ctx.all_gather_object(mine)
    ratio = mine["zb1"] / mine["1f1b"]
    pipeline = max(r["zb1"] for r in every) / max(r["1f1b"] for r in every)
    detail = "; ".join(f"rank {r}: 1f1b {p['1f1b'] / 2**10:.0f} KiB, zb1 {p['zb1'] / 2**10:.0f} KiB"
                       for r, p in enumerate(every)) + f"; pipeline peak {pipeline:.3f}x"
    if ctx.rank == 0 and ratio > SLACK:
        raise AssertionError(f"stage 0: zb1 peak {mine['zb1']} B > {SLACK}x 1F1B's {mine['1f1b']} B ({detail})")
    if pipeline > SLACK:
        raise AssertionError(f"pipeline peak {pipeline:.3f}x 1F1B's > {SLACK}x ({detail})")
    return detail


def check_weight_work(ctx) -> str:
    engine = dl.HybridEngine(build("resnet"), dl.ParallelConfig(**KNOBS, schedule="zb1"), ctx,
                             loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    (x, y), = batches("resnet", 8, 16, seed=5)[:1]
    params = [p for inst in engine.instances.values() for p in inst.canonical.parameters()]
    previous: list[Action] = []
    with_grad: dict[ActionKind, int] = {}

    def look(action: Action) -> None:   # called before each action: the previous one has run
        if previous and previous[-1].micro_batch == 0 and previous[-1].kind in (IN, W):
            with_grad[previous[-1].kind] = sum(p.grad is not None for p in params)
        previous.append(action)

    engine.train_step(x, y, look)
    split = engine.held_stages() != [0]
    want = (0 if split else len(params), len(params))
    if (with_grad.get(IN), with_grad.get(W)) != want:
        raise AssertionError(f"stage {engine.held_stages()}: parameters with a gradient after micro-batch 0's I: "
                             f"{with_grad.get(IN)}, after its W: {with_grad.get(W)} of {len(params)} (want {want})")
    return f"{len(params)} parameters: {want[0]} with a gradient after I0, all after W0"


def check_spatial_weight_half(ctx) -> str:
    cfg = dl.ParallelConfig(split_size=3, spatial_size=2, num_spatial_parts=2, slice_method="vertical", parts=3,
                            schedule="zb1", balance=(1, 1, 3))
    engine = dl.HybridEngine(build("resnet"), cfg, ctx, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    (x, y), = batches("resnet", 3, 16, seed=6)[:1]
    calls = [0]
    for name in ("exchange", "all_reduce"):
        method = getattr(ctx, name)

        def counted(*args, method=method, **kwargs):
            calls[0] += 1
            return method(*args, **kwargs)
        setattr(ctx, name, counted)
    params = [p for inst in engine.instances.values() for p in inst.canonical.parameters()]
    moved = {IN: 0, W: 0}
    graded = {IN: 0, W: 0}           # parameters with a gradient after micro-batch 0's I and after its W
    last: list[tuple[Action, int]] = []

    def look(action: Action) -> None:
        if last and last[-1][0].kind in moved:
            moved[last[-1][0].kind] += calls[0] - last[-1][1]
            if last[-1][0].micro_batch == 0:
                graded[last[-1][0].kind] = sum(p.grad is not None for p in params)
        last.append((action, calls[0]))

    try:
        engine.train_step(x, y, look)
    finally:
        for name in ("exchange", "all_reduce"):
            delattr(ctx, name)
    stages = engine.held_stages()
    if stages not in ([0], [1]):
        return f"layer rank: {moved}"
    split = stages == [1]
    want = (0 if split else len(params), len(params))
    if moved[W] or not moved[IN] or (graded[IN], graded[W]) != want:
        raise AssertionError(f"stage {stages[0]} tile rank: exchanges/all-reduces in I {moved[IN]}, in W {moved[W]} "
                             f"(want > 0 and 0); parameters with a gradient after I0 {graded[IN]}, after W0 "
                             f"{graded[W]} of {len(params)} (want {want})")
    return (f"stage {stages[0]} tile rank ({'split' if split else 'not split'}): {moved[IN]} exchanges/all-reduces "
            f"in I, none in W; {want[0]} of {len(params)} parameters with a gradient after I0, all after W0")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = dl.init()
    if ctx.world_size == 5:
        with check("zb1 spatial W exchanges nothing") as result:
            result.detail = check_spatial_weight_half(ctx)
        ctx.barrier()
        return
    with check("zb1 activation peak") as result:
        result.detail = check_peak(ctx)
    with check("zb1 W does the weight work") as result:
        result.detail = check_weight_work(ctx)
    with check("zbv activation peak") as result:
        result.detail = check_zbv_peak(ctx)
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
