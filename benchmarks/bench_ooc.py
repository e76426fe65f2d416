"""Out-of-core: the largest square image one training step of a ResNet-50-style trunk takes per rank budget.

Side by side in one run (``mpiexec -n 4``; every rank one thread):

* ``serial``: the plain trunk on rank 0;
* ``SP 4``: the trunk spatialized on a 2x2 tile grid (``dl.spatialize``);
* ``SP 4 + recompute``: the same, ``checkpoint_activations='every'`` (each block a segment:
  only block boundaries are kept; the halo exchanges are re-done in the recomputation);
* ``SP 4 + recompute + bf16``: the same under bf16 autocast (float32 weights).

Memory is *counted*, not read from RSS: ``measure.usage.ActivationMeter``, the meter the train
command reports (bytes autograd saves for backward, each storage once, parameters excluded),
around one whole step (forward, backward, and so the recomputation inside backward). A size
fits when the largest rank's peak is within ``--budget-mib``. The search is a bisection over
image sides in multiples of 32 (the trunk's stride; 64 on the 2x2 grid), bracketed from
a first measurement at ``--probe`` px (counted bytes grow linearly with the pixels).

Then the step-time cost of recomputation: the SP 4 step at ``--time-size`` with and without,
steps alternating, median of ``--steps`` each, and the halo exchanges (count, seconds) of a step.

The trunk: ResNet-50's layout (7x7/2 stem, 3x3/2 max pool, bottleneck stages of 3, 4, 6, 3
blocks, expansion 4, stride in the 3x3 conv) with base width ``--width`` (ResNet-50: 64).
Activation bytes are proportional to the width (every layer's channels are), so a run at
width w with budget B*w/64 finds the sides of width 64 and budget B at a fraction of the time.

    export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 OMP_NUM_THREADS=1
    mpiexec -n 4 python benchmarks/bench_ooc.py --width 64 --budget-mib 2048        # the goal's setting
    mpiexec -n 4 python benchmarks/bench_ooc.py --width 8 --budget-mib 256          # same sides, 1/64 compute
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from support.machine import Footer
from support.tables import Table
from support.world import require_world
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.measure.usage import ActivationMeter
from mpi4dl_nb.pipeline.recompute import checkpointed
from mpi4dl_nb.spatial.convert import runtime_of

GRID = (2, 2)
STRIDE = 32   # the trunk's output stride: sides are multiples of it (times the grid when spatial)
MIB = 2.0 ** 20


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1, 3x3 (stride), 1x1 (x4), projection shortcut when the shape changes."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def resnet50_trunk(width: int = 64) -> nn.Sequential:
    """Stem and the 16 bottleneck blocks of ResNet-50 (no head): 17 layers."""
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                             nn.ReLU(), nn.MaxPool2d(3, 2, 1))]
    cin = width
    for stage, blocks in enumerate((3, 4, 6, 3)):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(Bottleneck(cin, width * 2 ** stage, stride))
            cin = width * 2 ** stage * 4
    return nn.Sequential(*layers)


class Setting:
    """One column of the table: how the trunk runs on this rank (or None: this rank idles)."""

    def __init__(self, name: str, spatial: bool, recompute: bool, bf16: bool) -> None:
        self.name, self.spatial, self.recompute, self.bf16 = name, spatial, recompute, bf16

    def build(self, ctx: Comm, width: int) -> nn.Module | None:
        torch.manual_seed(0)
        trunk = resnet50_trunk(width)
        if not self.spatial:
            return trunk if ctx.rank == 0 else None
        net = dl.spatialize(trunk, dl.TileGrid(*GRID), ctx, check_ops=False)
        return checkpointed(net, "every", runtime_of(net)) if self.recompute else net

    def autocast(self) -> object:
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else nullcontext()

    @property
    def multiple(self) -> int:
        return STRIDE * GRID[0] if self.spatial else STRIDE

    def input_shape(self, side: int) -> tuple[int, int, int, int]:
        if self.spatial:
            return (1, 3, side // GRID[0], side // GRID[1])
        return (1, 3, side, side)


def one_step(net: nn.Module, setting: Setting, side: int) -> int:
    """Counted activation peak (bytes) of one forward + backward of ``net`` at ``side`` px."""
    x = torch.randn(setting.input_shape(side))
    meter = ActivationMeter(exclude=list(net.parameters()))
    with meter:
        with setting.autocast():   # type: ignore[attr-defined]
            out = net(x)
        out.float().sum().backward()
    net.zero_grad(set_to_none=True)
    return meter.peak


def peak_at(ctx: Comm, net: nn.Module | None, setting: Setting, side: int) -> int:
    """The largest rank's counted peak at ``side`` (collective)."""
    mine = one_step(net, setting, side) if net is not None else 0
    return max(ctx.all_gather_object(mine))


def largest_side(ctx: Comm, net: nn.Module | None, setting: Setting, budget: float, probe: int,
                 log: Callable[[str], None]) -> tuple[int, int, int]:
    """(largest fitting side, its peak, evaluations): bracket from the probe, then bisect."""
    evaluations = 0

    def fits(side: int) -> tuple[bool, int]:
        nonlocal evaluations
        evaluations += 1
        peak = peak_at(ctx, net, setting, side)
        log(f"  {setting.name}: {side} px -> {peak / MIB:.1f} MiB")
        return peak <= budget, peak

    ok, peak = fits(probe)
    if not ok:
        raise SystemExit(f"{setting.name}: even the probe {probe} px needs {peak / MIB:.0f} MiB; lower --probe")
    step = setting.multiple
    guess = int(probe * (budget / peak) ** 0.5) // step * step
    lo, lo_peak, hi = probe, peak, None
    side = max(guess, probe + step)
    while hi is None:   # bracket: grow 10% past the linear guess until a side does not fit
        ok, peak = fits(side)
        if ok:
            lo, lo_peak = side, peak
            side = (int(side * 1.1) // step + 1) * step
        else:
            hi = side
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        ok, peak = fits(mid)
        if ok:
            lo, lo_peak = mid, peak
        else:
            hi = mid
    return lo, lo_peak, evaluations


def one_timed_step(ctx: Comm, net: nn.Module, setting: Setting, side: int) -> tuple[float, int, float]:
    """(slowest rank's step seconds, halo exchanges, their seconds on this rank) of one step."""
    x = torch.randn(setting.input_shape(side))
    before = ctx.tracer.totals().get("halo")
    ctx.barrier()
    start = time.perf_counter()
    with setting.autocast():   # type: ignore[attr-defined]
        out = net(x)
    out.float().sum().backward()
    net.zero_grad(set_to_none=True)
    seconds = max(ctx.all_gather_object(time.perf_counter() - start))
    after = ctx.tracer.totals().get("halo")
    count = (after.count if after else 0) - (before.count if before else 0)
    return seconds, count, (after.seconds if after else 0.0) - (before.seconds if before else 0.0)


def step_times(ctx: Comm, nets: list[nn.Module], settings: list[Setting], side: int,
               steps: int) -> list[tuple[float, int, float]]:
    """Per setting: median step seconds, halo exchanges and their seconds per step; the
    settings' steps alternate (a warm-up round first), so load changes hit them alike."""
    runs: list[list[tuple[float, int, float]]] = [[] for _ in nets]
    for _ in range(steps + 1):
        for net, setting, run in zip(nets, settings, runs):
            run.append(one_timed_step(ctx, net, setting, side))
    return [(statistics.median(r[0] for r in run[1:]), run[-1][1], statistics.median(r[2] for r in run[1:]))
            for run in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64, help="base width (ResNet-50: 64)")
    parser.add_argument("--budget-mib", type=float, default=2048.0, help="per-rank activation budget")
    parser.add_argument("--probe", type=int, default=256, help="first side measured (px, multiple of 64)")
    parser.add_argument("--time-size", type=int, default=512, help="side of the step-time comparison")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    footer = Footer()
    torch.set_num_threads(1)
    ctx = dl.init()
    require_world(ctx, GRID[0] * GRID[1])
    say = print if ctx.rank == 0 else (lambda *_: None)
    budget = args.budget_mib * MIB
    settings = [Setting("serial", False, False, False), Setting("SP 4", True, False, False),
                Setting("SP 4 + recompute", True, True, False),
                Setting("SP 4 + recompute + bf16", True, True, True)]
    say(f"ResNet-50 trunk, width {args.width}, budget {args.budget_mib:.0f} MiB of counted activations "
        f"per rank, batch 1")
    rows = []
    for setting in settings:
        net = setting.build(ctx, args.width)
        side, peak, evaluations = largest_side(ctx, net, setting, budget, args.probe, say)
        rows.append((setting.name, side, peak, evaluations))
        del net
    serial_pixels = rows[0][1] ** 2
    table = Table([f"configuration (width {args.width}, {args.budget_mib:g} MiB per rank)", ">largest side",
                   ">pixels vs serial", ">counted peak MiB", ">steps measured"])
    for name, side, peak, evaluations in rows:
        table.add(name, side, f"{side * side / serial_pixels:.1f}x", f"{peak / MIB:.1f}", evaluations)
    say("\n" + table.markdown())
    timed = settings[1:3] + [Setting("SP 4 + bf16", True, False, True)]   # recomputation; bf16 vs fp32
    nets = [setting.build(ctx, args.width) for setting in timed]
    timing = [(setting.name, *result) for setting, result in
              zip(timed, step_times(ctx, [n for n in nets if n is not None], timed, args.time_size, args.steps))]
    say(f"\nSP 4 step at {args.time_size} px (median of {args.steps}, alternating; halo exchanges of rank 0 per step)")
    table = Table(["setting", ">step s", ">halo exchanges", ">their ms"])
    for name, seconds, halos, halo_seconds in timing:
        table.add(name, f"{seconds:.3f}", halos, f"{halo_seconds * 1e3:.1f}")
    say(table.markdown())
    say(f"recomputation cost: {timing[1][1] / timing[0][1]:.2f}x step time (goal < 1.35x)")
    say(f"bf16 vs fp32 (no recomputation): {timing[2][1] / timing[0][1]:.2f}x step time")
    ctx.barrier()
    if ctx.rank == 0:
        footer.print()


if __name__ == "__main__":
    main()
