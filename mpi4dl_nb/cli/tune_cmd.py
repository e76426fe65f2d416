"""``python -m mpi4dl_nb tune``: the planner's best configurations, run for a few steps on this job.

    mpiexec -n 5 python -m mpi4dl_nb tune --model resnet --num-layers 20 --num-filters 8 \\
        --image-size 256 --batch-size 2 --memory-limit-mb 200 --top 3 --steps 2

Every rank takes part: a ping-pong calibrates the network model (the crowded-core rounds too
when the ranks outnumber a CPU node's cores), rank 0 runs ``suggest`` for this world size and
the memory limit on the ranks' device (layer times and copy speed measured there; the others
wait), then the one-process reference and each of the ``--top`` configurations are built side
by side on the ranks (a warm-up and a memory-measured step each) and timed in ``--rounds``
rounds of ``--steps`` steps, one step of each in turn (a slow spell of the machine falls on all
of them alike; each one's time is the median of its steps), each timed step right after an untimed one
of its own (its memory in cache again, as in training); ranks with no part in the one-process
reference wait for it asleep. Rank 0 prints predicted next to
measured and picks the fastest configuration whose measured peak fits; ``--explain`` adds each
rank's predicted and traced seconds per action kind (which part of a prediction is off);
``--save-json PATH`` writes the table (with those phases). One rank, or a
memory limit no configuration fits, exits non-zero with one line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..comm.waiting import barrier_asleep
from ..config import DTYPE, ConfigError, ParallelConfig
from ..data.options import IMAGE_SIZE
from ..models.model_args import NO_ARGS, ModelArgs
from ..models.options import MODEL, MODEL_ARGS, NUM_CLASSES, NUM_FILTERS, NUM_LAYERS
from ..models.spec import ModelFamily
from ..run import flag_groups as groups
from ..run.training_spec import BATCH_SIZE, STEPS
from ..schema import Bounds, build_job, check_bounds, flag, number, whole_number
from .args import parallel_flags
from .flag_names import as_flags
from .job_flags import add_job_flags, keyword_values
from .parser import CommandParser, DefaultsHelpFormatter

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..measure.trials import Measured, Row
    from ..planner.timing import Network
    from ..planner.tune import Tuner, TuneResult

GROUP = "tune"


def measuring_flag(option: str, help: str, default: int) -> int:
    """A count of how much ``tune`` runs (at least 1)."""
    return flag(option, help, default, parse=whole_number, bounds=Bounds(1), group=GROUP)


@dataclass(frozen=True)
class TuneJob:
    """What ``tune`` is asked: the model and workload, the memory limit, how many configurations to run and how."""

    memory_limit_mb: float = flag("--memory-limit-mb", "bytes each rank may use, in MiB", parse=number, group=GROUP)
    model: str = MODEL.field(ModelFamily.RESNET.value, group=groups.MODEL)
    model_args: ModelArgs = MODEL_ARGS.field(NO_ARGS, default_text="none", group=groups.MODEL)
    num_layers: int | None = NUM_LAYERS.field(None, group=groups.MODEL)
    num_filters: int | None = NUM_FILTERS.field(None, group=groups.MODEL)
    num_classes: int = NUM_CLASSES.field(2, group=groups.MODEL)
    image_size: int = IMAGE_SIZE.field(128, group=groups.MODEL)
    batch_size: int = BATCH_SIZE.field(2, group=groups.MODEL)
    top: int = measuring_flag("--top", "configurations to run (planner's best first)", 3)
    steps: int = STEPS.field(4, group=GROUP)
    rounds: int = measuring_flag("--rounds", "rounds of --steps steps, one step of every configuration in turn (the "
                                           "machine's slow spells fall on all of them alike); each one's time is the "
                                           "median of its steps", 2)
    headroom: float | None = flag("--headroom", "share of --memory-limit-mb suggest leaves free for its estimate's "
                                                "error (default suggest's, 8%; 0: none); the pick itself is by "
                                                "measured peak against the whole limit", None, parse=number,
                                  group=GROUP)
    max_split: int = flag("--max-split", "the most stages a configuration may have", 4, parse=whole_number,
                          group=GROUP)
    dtype: str = DTYPE.field("float32", group=groups.MODEL)
    explain: bool = flag("--explain", "also print, per configuration, each rank's predicted and traced seconds per "
                                      "step by action kind (forward, backward, receives, all-reduce ...) and the "
                                      "largest gap", False, switch=True, group=GROUP)
    save_json: str | None = flag("--save-json", "write the result as JSON to this path (rank 0)", None, metavar="PATH",
                                 old=("--json",), group=GROUP)

    def __post_init__(self) -> None:
        check_bounds(self)
        if not isinstance(self.image_size, int):
            raise ConfigError("--image-size", f"tune plans square images: give one side N, not "
                                              f"{','.join(map(str, self.image_size))}")
        if self.headroom is not None and not 0 <= self.headroom < 1:
            raise ConfigError("--headroom", "is a share of the limit: from 0 to below 1")
        if ModelFamily.parse(self.model).dense:
            raise ConfigError("--model", f"{self.model}: tune times classifiers (a class per image); a segmentation "
                                     f"model's layouts are chosen by hand for now (docs/segmentation.md)")


def tune_parser() -> CommandParser:
    parser = CommandParser(prog="python -m mpi4dl_nb tune", formatter_class=DefaultsHelpFormatter,
                           description="Run the planner's best configurations on this job; pick the fastest "
                                       "that fits the memory limit.")
    return add_job_flags(parser, TuneJob)


def tune_job(args: argparse.Namespace) -> TuneJob:
    """The job of parsed flags (ConfigError naming a flag out of range)."""
    return build_job(TuneJob, keyword_values(args, TuneJob), "tune")


def train_command(job: TuneJob, cfg: ParallelConfig) -> str:
    """The ``train`` command line of the pick: this job's model, sizes and dtype, and ``cfg``'s flags."""
    model = ["--model", job.model, "--num-classes", str(job.num_classes), "--image-size", str(job.image_size),
             "--batch-size", str(job.batch_size)]
    for option, value in (("--num-layers", job.num_layers), ("--num-filters", job.num_filters)):
        model += [option, str(value)] if value is not None else []
    model += ["--model-args", job.model_args.text()] if job.model_args else []
    model += ["--dtype", job.dtype] if job.dtype != "float32" else []
    try:
        flags = parallel_flags(cfg)
    except ConfigError as err:
        return f"(no train flags: {err})"
    return shlex.join(["mpiexec", "-n", str(cfg.world_size), "python", "-m", "mpi4dl_nb", "train", *model, *flags])


def tuner_of(job: TuneJob, world_size: int) -> Tuner:
    """The tuner of ``job`` on ``world_size`` ranks."""
    from ..measure import trials
    from ..planner.memory import MB
    from ..planner.suggest import SuggestOptions
    from ..planner.tune import Tuner

    spec = trials.trial_model(job.model, job.num_layers, job.num_filters, job.num_classes, dtype=job.dtype,
                              model_args=job.model_args, image_size=job.image_size)
    options = SuggestOptions(max_split=job.max_split)
    if job.headroom is not None:
        options["headroom"] = job.headroom
    return Tuner(spec, job.image_size, job.batch_size, job.memory_limit_mb * MB, world_size, trials.here,
                 top=job.top, steps=job.steps, rounds=job.rounds, suggest_options=options)


def planned_on_rank0(tuner: Tuner, network: Network, ctx: Comm) -> tuple[TuneResult | None, list[Row] | None]:
    """Rank 0 plans (the others wait): its result there, and every rank the candidates' knobs (None: a failure,
    said once by rank 0)."""
    planned: TuneResult | None = None
    failure = None
    if ctx.rank == 0:
        try:
            planned = tuner.plan(network)
            print(planned.suggestions.table() if planned.suggestions is not None else "", flush=True)
        except ValueError as err:
            failure = str(err)
    mine: list[Row] | None = None if planned is None else [r.cfg.as_dict() for r in planned.candidates
                                                            if r.cfg is not None]
    barrier_asleep(ctx, ctx.rank != 0)   # rank 0 times the layers meanwhile, one process's on every core
    knobs = ctx.bcast_object(mine)
    failure = ctx.bcast_object(failure)
    if failure is not None and ctx.rank == 0:
        print(f"mpi4dl_nb tune: {failure}", file=sys.stderr)
    return planned, None if failure is not None else knobs


def report(job: TuneJob, planned: TuneResult, network: Network, reference: Measured,
           measured: Sequence[Measured]) -> int:
    """Rank 0: predicted next to measured, the pick and its train command, the JSON file; 1 when nothing fits."""
    from ..planner.suggest import describe_config

    planned.rows[0].measured = reference
    for row, result in zip(planned.candidates, measured):
        row.measured = result
    print(f"\nnetwork: {network.describe()}; memory limit {job.memory_limit_mb:.1f} MB per rank\n")
    print(planned.table())
    if job.explain:
        print(f"\n{planned.explain() or 'no configuration was traced (tracing is off on these ranks)'}")
    if planned.best is not None and planned.best.cfg is not None:
        print(f"\nuse: {describe_config(planned.best.cfg)}  ({json.dumps(planned.best.cfg.as_dict())})")
        print(f"train with: {train_command(job, planned.best.cfg)}")
    if job.save_json:
        with open(job.save_json, "w") as handle:
            json.dump(planned.as_dict(), handle, indent=2)
    return 0 if planned.best is not None else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb tune``: bad flags are a usage error before any rank starts."""
    parser = tune_parser()
    try:
        job = tune_job(parser.parse_args(argv))
    except ConfigError as err:
        parser.error(as_flags(str(err)))
    from ..comm.context import init
    from ..measure import trials
    from ..measure.calibration import calibrate_job
    from .layout_cmd import refuse

    ctx = init()
    if ctx.world_size < 2:   # every rank decides alike: no rank waits for another
        refuse("tune compares parallel configurations: run it on at least 2 ranks (mpiexec -n N, N >= 2)",
               ctx.rank, ctx.world_size)
    tuner = tuner_of(job, ctx.world_size)
    network = tuner.calibrated(calibrate_job(ctx))     # the ranks' device: where the planner measures
    planned, knobs = planned_on_rank0(tuner, network, ctx)
    if knobs is None:
        return 1
    reference, *measured = trials.measure_interleaved(trials.here, tuner.spec, [None, *knobs], job.image_size,
                                                    job.batch_size, job.steps, job.rounds)
    if ctx.rank != 0 or planned is None:
        return 0
    return report(job, planned, network, reference, measured)
