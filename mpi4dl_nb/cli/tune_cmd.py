"""``python -m mpi4dl_nb tune``: the planner's best configurations, run for a few steps on this job.

    mpiexec -n 5 python -m mpi4dl_nb tune --model resnet --num-layers 20 --num-filters 8 \\
        --image-size 256 --batch-size 2 --memory-limit-mb 200 --top 3 --steps 2

Every rank takes part: a ping-pong calibrates the network model (the crowded-core rounds too
when the ranks outnumber a CPU node's cores), rank 0 runs ``suggest`` for this world size and
the memory limit on the ranks' device (layer times and copy speed measured there; the others
wait), then the one-process reference and each of the ``--top`` configurations are built side
by side on the ranks (a warm-up and a memory-measured step each) and timed in ``--rounds``
rounds of ``--steps`` steps, one step of each in turn (a slow spell of the machine falls on all
of them alike; each one's time is the median of its steps). Rank 0 prints predicted next to
measured and picks the fastest configuration whose measured peak fits; ``--explain`` adds each
rank's predicted and traced seconds per action kind (which part of a prediction is off);
``--json PATH`` writes the table (with those phases). One rank, or a
memory limit no configuration fits, exits non-zero with one line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence

from ..config import ConfigError, ParallelConfig
from ..models.spec import ModelFamily
from .args import parallel_flags
from .model_flags import add_model_flag
from .parser import CommandParser, DefaultsHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m mpi4dl_nb tune", formatter_class=DefaultsHelpFormatter,
                           description="Run the planner's best configurations on this job; pick the fastest "
                                       "that fits the memory limit.")
    add_model_flag(parser, ModelFamily.RESNET.value)
    parser.add_argument("--num-layers", dest="num_layers", type=int, default=None,
                        help="ResNet depth (v2: 9n+2) / AmoebaNet normal cells")
    parser.add_argument("--num-filters", dest="num_filters", type=int, default=None,
                        help="ResNet base width / AmoebaNet filters")
    parser.add_argument("--num-classes", dest="num_classes", type=int, default=2)
    parser.add_argument("--image-size", dest="image_size", type=int, default=128)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=2)
    parser.add_argument("--memory-limit-mb", dest="memory_limit_mb", type=float, required=True,
                        help="bytes each rank may use, in MiB")
    parser.add_argument("--top", type=int, default=3, help="configurations to run (planner's best first)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of --steps steps, one step of every configuration in turn (the machine's "
                             "slow spells fall on all of them alike); each one's time is the median of its steps")
    parser.add_argument("--headroom", type=float, default=None,
                        help="share of --memory-limit-mb suggest leaves free for its estimate's error (default "
                             "suggest's, 8%%; 0: none); the pick itself is by measured peak against the whole limit")
    parser.add_argument("--max-split", dest="max_split", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--explain", action="store_true",
                        help="also print, per configuration, each rank's predicted and traced seconds per step by "
                             "action kind (forward, backward, receives, all-reduce ...) and the largest gap")
    parser.add_argument("--json", default=None, help="write the result as JSON to this path (rank 0)")
    return parser


def train_command(args: argparse.Namespace, cfg: ParallelConfig) -> str:
    """The ``train`` command line of the pick: this job's model, sizes and dtype, and ``cfg``'s flags."""
    model = ["--model", args.model, "--num-classes", str(args.num_classes), "--image-size", str(args.image_size),
             "--batch-size", str(args.batch_size)]
    for flag, value in (("--num-layers", args.num_layers), ("--num-filters", args.num_filters)):
        model += [flag, str(value)] if value is not None else []
    model += ["--dtype", args.dtype] if args.dtype != "float32" else []
    try:
        flags = parallel_flags(cfg)
    except ConfigError as err:
        return f"(no train flags: {err})"
    return shlex.join(["mpiexec", "-n", str(cfg.world_size), "python", "-m", "mpi4dl_nb", "train", *model, *flags])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.top < 1:
        parser.error("--steps, --rounds and --top must be at least 1")
    if args.headroom is not None and not 0 <= args.headroom < 1:
        parser.error("--headroom is a share of the limit: from 0 to below 1")
    if ModelFamily.parse(args.model).dense:
        parser.error(f"--model {args.model}: tune times classifiers (a class per image); a segmentation model's "
                     f"layouts are chosen by hand for now (docs/segmentation.md)")
    from ..comm.context import init
    from ..measure import trials
    from ..measure.calibration import calibrate_job
    from ..planner.memory import MB
    from ..planner.suggest import describe_config
    from ..planner.tune import Tuner, TuneResult
    from .layout_cmd import refuse

    ctx = init()
    if ctx.world_size < 2:   # every rank decides alike: no rank waits for another
        refuse("tune compares parallel configurations: run it on at least 2 ranks (mpiexec -n N, N >= 2)",
               ctx.rank, ctx.world_size)
    spec = trials.trial_model(args.model, args.num_layers, args.num_filters, args.num_classes, dtype=args.dtype)
    limit = args.memory_limit_mb * MB
    tuner = Tuner(spec, args.image_size, args.batch_size, limit, ctx.world_size, trials.here, top=args.top,
                  steps=args.steps, rounds=args.rounds, suggest_options={"max_split": args.max_split,
                                   **({} if args.headroom is None else {"headroom": args.headroom})})
    network = tuner.calibrated(calibrate_job(ctx))     # the ranks' device: where the planner measures
    planned: TuneResult | None = None
    failure = None
    if ctx.rank == 0:
        try:
            planned = tuner.plan(network)
            print(planned.suggestions.table() if planned.suggestions is not None else "", flush=True)
        except ValueError as err:
            failure = str(err)
    knobs = ctx.bcast_object(None if planned is None else [r.cfg.as_dict() for r in planned.candidates
                                                              if r.cfg is not None])
    failure = ctx.bcast_object(failure)
    if failure is not None:
        if ctx.rank == 0:
            print(f"mpi4dl_nb tune: {failure}", file=sys.stderr)
        return 1
    assert knobs is not None, "rank 0 planned (no failure)"
    reference, *measured = trials.measure_interleaved(trials.here, spec, [None, *knobs], args.image_size,
                                                    args.batch_size, args.steps, args.rounds)
    if ctx.rank != 0 or planned is None:
        return 0
    planned.rows[0].measured = reference
    for row, result in zip(planned.candidates, measured):
        row.measured = result
    print(f"\nnetwork: {network.describe()}; memory limit {args.memory_limit_mb:.1f} MB per rank\n")
    print(planned.table())
    if args.explain:
        print(f"\n{planned.explain() or 'no configuration was traced (tracing is off on these ranks)'}")
    if planned.best is not None and planned.best.cfg is not None:
        print(f"\nuse: {describe_config(planned.best.cfg)}  ({json.dumps(planned.best.cfg.as_dict())})")
        print(f"train with: {train_command(args, planned.best.cfg)}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(planned.as_dict(), handle, indent=2)
    return 0 if planned.best is not None else 1
