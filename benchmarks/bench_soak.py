"""Soak: per-rank memory over thousands of training steps, through the Python API and through ``train``.

    python benchmarks/bench_soak.py [--steps 3000] [--sample-every 100] [--configs sp_lp,pipeline]
                                    [--modes api,train] [--backend mpi|gloo] [--from-step 2000]

For each configuration (``sp_lp``: 5 ranks, 2x2 tiles then a layer stage; ``pipeline``: 2 ranks,
1F1B, 4 micro-batches; ResNet v2 depth 11, width 8, 64 px, float32, as in issue 17) and each mode
(``api``: ``HybridEngine.train_step`` in a loop, as notebooks and custom scripts train; ``train``:
the CLI's ``Trainer`` loop, run through ``train_cmd.main``), it launches ``mpiexec``, samples every
rank's anonymous RSS (``RssAnon``: heap and tensors, without the libraries' file pages, which the kernel drops
and faults back in with the machine's memory pressure), the bytes of live tensors (gc-counted) and the trace's
event count every
``--sample-every`` steps, and prints one row per rank: RSS after warm-up and at the end, and the
growth per 1000 steps (least-squares slope over the second half of the run, i.e. after warm-up),
plus the trace length, and the RSS grown from the first sample at or after ``--from-step`` to the end (issue
54's measure: under 1 MB between steps 2,000 and 10,000 on every rank), the same between the highest RSS of the
first and the last 1,000 steps of that span (each holds one of the engine's heap releases, ``HeapRelease``, every
1,000 steps, so a sample falling just after one does not flatter the figure) and read off the line fitted through
every 1,000 steps' highest RSS (``--samples-out`` keeps the samples), and the bytes glibc's malloc has handed
out over the span (flat while RSS grows: the allocator's kept free space, not a leak). On the gloo plane
torch's collective flight recorder keeps ~0.9-1.3 KB per collective until its ring of 2000 is full
(``TORCH_FR_BUFFER_SIZE``, torch's default kept): the layer rank (1-2 collectives a step) fills it over its first
1,000-2,000 steps. ``--backend``: the data
plane of the API mode (``mpi``, or ``gloo``: torch.distributed). Issue 17's goal: API RSS growth under 1 MB per
10,000 steps (100 KB per 1000), trace bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from support.launch import last_json, run_job
from support.machine import REPO, Footer
from support.tables import Table

CONFIGS = {"sp_lp": 5, "pipeline": 2}
MARK = "@@SOAK "
MODEL = dict(depth=11, width=8, image=64, classes=10)
WINDOW = 1000   # steps of the windows whose highest RSS ``window_peak_growth`` compares


def config_flags(name: str) -> list[str]:
    """The train CLI's flags of a configuration (the API mode builds the same ParallelConfig)."""
    common = ["--model", "resnet", "--resnet-version", "2", "--num-layers", str(MODEL["depth"]),
              "--num-filters", str(MODEL["width"]), "--image-size", str(MODEL["image"]),
              "--num-classes", str(MODEL["classes"]), "--num-samples", "64", "--no-progress"]
    if name == "sp_lp":
        return common + ["--split-size", "2", "--spatial-size", "1", "--num-spatial-parts", "4",
                         "--batch-size", "2"]
    return common + ["--split-size", "2", "--spatial-size", "0", "--parts", "4", "--schedule",
                     "1f1b", "--batch-size", "8"]


# ------------------------------------------------------------------------ on every rank
def rank_program(name: str, mode: str, steps: int, every: int, backend: str = "auto") -> None:
    import torch

    from mpi4dl_nb.measure.heap import heap_in_use
    from mpi4dl_nb.measure.usage import anon_rss_bytes, live_tensor_bytes, rss_bytes

    torch.set_num_threads(1)
    samples: list[tuple[int, int, int, int, int]] = []

    def sample(step: int, tracer_length: int) -> None:
        if step % every == 0:
            samples.append((step, anon_rss_bytes() or rss_bytes() or 0, live_tensor_bytes(), tracer_length,
                            heap_in_use() or 0))

    if mode == "api":
        ctx = api_run(name, steps, sample, backend)
    else:
        ctx = train_run(name, steps, sample)
    gathered = ctx.gather_object(samples, root=0)
    if ctx.rank == 0:
        print(MARK + json.dumps({"config": name, "mode": mode, "steps": steps, "ranks": gathered}),
              flush=True)


def api_run(name: str, steps: int, sample, backend: str = "auto"):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.cli.job_flags import keyword_values
    from mpi4dl_nb.cli.train_cmd import train_parser
    from mpi4dl_nb.models import build_model
    from mpi4dl_nb.run.job import TrainJob

    job = TrainJob.of(**keyword_values(train_parser().parse_args(config_flags(name)), TrainJob))
    cfg, batch = job.config, job.training.batch_size
    ctx = dl.init(backend=backend)
    torch.manual_seed(0)
    layers = build_model("resnet", num_layers=MODEL["depth"], num_filters=MODEL["width"],
                         num_classes=MODEL["classes"], version=2, image_size=MODEL["image"])
    engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, MODEL["image"], MODEL["image"], generator=gen)
    y = torch.randint(0, MODEL["classes"], (batch,), generator=gen)
    for step in range(1, steps + 1):
        engine.train_step(x, y)
        sample(step, ctx.tracer.kept)
    return ctx


def train_run(name: str, steps: int, sample):
    from mpi4dl_nb.cli import train_cmd
    from mpi4dl_nb.comm.context import current
    from mpi4dl_nb.run import trainer as train_module

    original = train_module.Trainer.train_one

    def train_one(self):   # the CLI's own loop, sampled after each step
        loss = original(self)
        sample(self.step, self.ctx.tracer.kept)
        return loss

    train_module.Trainer.train_one = train_one
    with open(os.devnull, "w") as quiet:   # the CLI's JSON summary is not this benchmark's output
        stdout, sys.stdout = sys.stdout, quiet
        try:
            train_cmd.main(["--steps", str(steps), *config_flags(name)])
        finally:
            sys.stdout = stdout
    ctx = current()
    assert ctx is not None
    return ctx


# ------------------------------------------------------------------------------ driver
def slope_per_1000(points: list[tuple[int, int]]) -> float:
    from mpi4dl_nb.measure.usage import growth_per_step

    return 1000 * growth_per_step([(s, float(v)) for s, v in points])


def launch(name: str, mode: str, steps: int, every: int, backend: str = "auto") -> dict:
    done = run_job(CONFIGS[name], [sys.executable, "-m", "mpi4py", __file__, "--rank-program", name, mode, str(steps),
                                   str(every), backend], cwd=str(REPO))
    return last_json(done.stdout, MARK)


def window_peaks(samples: list, from_step: int, window: int = WINDOW) -> list[tuple[int, int]]:
    """(first step, highest RSS) of each whole ``window`` steps from ``from_step`` on: each window holds a whole
    period of the engine's heap release (``HeapRelease``, every 1000 steps), so its highest RSS does not depend on
    whether a sample falls just after a release."""
    end = samples[-1][0]
    starts = range(from_step, end - window + 2, window)
    peaks = [(start, max((rss for step, rss, *_ in samples if start <= step < start + window), default=-1))
             for start in starts]
    return [(start, peak) for start, peak in peaks if peak >= 0]


def window_peak_growth(samples: list, from_step: int, window: int = WINDOW) -> tuple[int, float]:
    """The highest RSS of the last window less that of the first (``window_peaks``), and the same read off the
    least-squares line through every window's highest RSS (one window's noise moves it less)."""
    peaks = window_peaks(samples, from_step, window) or [(samples[-1][0], samples[-1][1])]
    span = peaks[-1][0] - peaks[0][0]
    return peaks[-1][1] - peaks[0][1], slope_per_1000(peaks) * span / 1000 if len(peaks) > 1 else 0.0


def report(result: dict, table: Table, from_step: int) -> None:
    for rank, samples in enumerate(result["ranks"]):
        after = [sample for sample in samples if sample[0] >= from_step] or [samples[-1]]
        late = samples[len(samples) // 2:]
        rss = slope_per_1000([(s, r) for s, r, *_ in late])
        tensors = slope_per_1000([(s, t) for s, _, t, *_ in late])
        events = [e for _, _, _, e, *_ in samples]
        mib = 2.0 ** 20
        table.add(result["config"], result["mode"], rank, f"{late[0][1] / mib:.1f}", f"{samples[-1][1] / mib:.1f}",
                  f"{rss / 1024:+.1f}", f"{(after[-1][1] - after[0][1]) / 1024:+.0f}",
                  "{:+.0f} / {:+.0f}".format(*(v / 1024 for v in window_peak_growth(samples, from_step))),
                  f"{(after[-1][4] - after[0][4]) / 1024:+.0f}", f"{tensors / 1024:+.2f}",
                  f"{min(events)}-{max(events)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--modes", default="api,train")
    parser.add_argument("--backend", default="auto", help="the API mode's data plane: auto (mpi on CPU), mpi, gloo")
    parser.add_argument("--from-step", type=int, default=2000, help="RSS grown from this step to the end")
    parser.add_argument("--samples-out", help="also write every rank's samples (step, RSS, tensor bytes, trace "
                                              "events, heap in use) to this JSON file")
    args = parser.parse_args()
    footer = Footer()
    runs = []
    print(f"# ResNet v2-{MODEL['depth']} width {MODEL['width']}, {MODEL['image']} px, float32; "
          f"{args.steps} steps, sampled every {args.sample_every}; growth = slope over the 2nd half; "
          f"backend {args.backend}")
    table = Table(["config", "mode", ">rank", ">RSS at half MiB", ">RSS at end MiB", ">RSS growth KiB/1000 steps",
                   f">RSS grown steps {args.from_step}-{args.steps} KiB",
                   f">highest RSS of each {WINDOW} steps from {args.from_step}: last less first / fitted line KiB",
                   f">malloc in use grown steps {args.from_step}-{args.steps} KiB",
                   ">tensor bytes growth KiB/1000 steps", "trace events (min-max)"])
    for name in args.configs.split(","):
        for mode in args.modes.split(","):
            runs.append(launch(name, mode, args.steps, args.sample_every, args.backend))
            report(runs[-1], table, args.from_step)
            print(f"  {name} {mode}: done", file=sys.stderr, flush=True)
    print(table.markdown())
    if args.samples_out:
        with open(args.samples_out, "w") as out:
            json.dump(runs, out)
    footer.print()


if __name__ == "__main__":
    if "--rank-program" in sys.argv:
        at = sys.argv.index("--rank-program")
        config, mode_, steps_, every_, backend_ = sys.argv[at + 1:at + 6]
        rank_program(config, mode_, int(steps_), int(every_), backend_)
    else:
        main()
