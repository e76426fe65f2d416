"""``python -m mpi4dl_nb train``: MPI4DL-compatible batch training (any SP/LP/PP/GEMS/DP mix) with checkpoints."""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.record import DataRecord, RunRecord
from ..config import ConfigError, ParallelConfig
from ..data.apps import AppKind
from ..evaluation.metrics import MetricName
from ..models.spec import ModelFamily, ModelSpec
from ..run.divergence import EXIT_NONFINITE, OnNonFinite
from ..run.identity import parse_allowed
from .args import add_mpi4dl_args
from .device_flags import add_device_flags, check_device_flags
from .model_flags import VERSION_HELP, add_model_flag, add_pretrained_flags, check_model_flags, model_spec
from .parser import CommandParser, DefaultsHelpFormatter
from .resolution_flags import add_resolution_flags, check_resolution_flags
from .segmentation_flags import (
    add_task_args,
    check_task_args,
    check_task_classes,
    data_sources,
    label_counts,
    saved_task,
    segmentation_record,
    task_identity,
    task_mismatch,
    task_of,
)
from .training_flags import add_training_args, check_keep_best, check_training_args, optimizer_spec, training_record

if TYPE_CHECKING:
    from torch import nn

    from ..comm.protocol import Comm
    from ..data.dataset import Batcher, RegionDataset
    from ..data.validate import DataSources
    from ..evaluation.evaluator import Evaluator
    from ..evaluation.pixel_evaluator import SegmentationEvaluator
    from ..run.data_check import DataRole
    from ..run.monitor import JobMonitor
    from ..run.resume import Selection
    from ..run.trainer import Trainer
    from .segmentation_flags import Checker

EXIT_SETUP = 2
DTYPES = ("float32", "float64")
# errors of set-up that are the user's input, reported as one message (anything else is a crash)
SETUP_ERRORS = (ConfigError, ValueError, FileNotFoundError, KeyError, OSError)


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` parser: every MPI4DL benchmark flag plus model, checkpoint and run options."""
    parser = CommandParser(
        prog="python -m mpi4dl_nb train",
        description="Train ResNet, AmoebaNet-D or your own CNN (torchvision:, timm:, package.module:callable) "
                    "with hybrid spatial/layer/pipeline/GEMS/data "
                    "parallelism, exactly like one process. Launch with mpiexec -n <ranks>; "
                    "'python -m mpi4dl_nb layout <flags>' tells how many.",
        formatter_class=DefaultsHelpFormatter)
    add_model_flag(parser, ModelFamily.RESNET.value)
    add_pretrained_flags(parser)
    parser.add_argument("--resnet-version", dest="resnet_version", type=int, choices=(1, 2),
                        default=None, help=VERSION_HELP)
    add_mpi4dl_args(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=None,
                     help="total optimizer steps (default: num-epochs x batches per epoch)")
    run.add_argument("--seed", type=int, default=0, help="seed of weights and data order")
    run.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter/activation dtype")
    run.add_argument("--num-samples", dest="num_samples", type=int, default=256,
                     help="images in the synthetic dataset")
    run.add_argument("--slide-level", dest="slide_level", type=int, default=0,
                     help="--app medical with slides: pyramid level the tiles are cut from")
    add_resolution_flags(run, "--app medical; recorded in the checkpoint as infer's default")
    run.add_argument("--min-tissue", dest="min_tissue", type=float, default=0.5,
                     help="--app medical with slides: least tissue fraction of a kept tile")
    add_device_flags(run)
    run.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar on rank 0")
    run.add_argument("--skip-bad-files", dest="skip_bad_files", action="store_true",
                     help="train on the usable files when the data check finds bad ones (default: refuse)")
    run.add_argument("--on-nonfinite", dest="on_nonfinite", choices=[p.value for p in OnNonFinite],
                     default=OnNonFinite.STOP.value,
                     help="a NaN/inf loss or gradient stops the run (exit 3), or skips that step")
    run.add_argument("--step-timeout", dest="step_timeout", type=float, default=None, metavar="SECONDS",
                     help="abort the job when a rank makes no progress for this long, naming it "
                          "(default: 10x the slowest of the first 3 steps, at least 60 s; 0: off)")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", dest="checkpoint_dir", default=None,
                      help="write atomic checkpoints step-NNNNNNNN-<run>.pt (+ .json manifest) here")
    ckpt.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=0,
                      help="checkpoint every N steps (0: at each epoch end and at the end)")
    ckpt.add_argument("--keep-checkpoints", dest="keep_checkpoints", type=int, default=2,
                      help="how many newest checkpoints of this run to keep")
    ckpt.add_argument("--keep-best", dest="keep_best", choices=MetricName.values(), default=None, metavar="METRIC",
                      help=f"also keep the checkpoint of the best evaluation by METRIC "
                           f"({', '.join(MetricName.values())}; lower val_loss, higher others is better) as "
                           f"best-step-*.pt, never rotated away")
    ckpt.add_argument("--resume", default=None,
                      help="continue from a checkpoint file, a directory, or 'latest' "
                           "(in --checkpoint-dir): the newest intact one of this configuration")
    ckpt.add_argument("--allow-config-change", dest="allow_config_change", action="append",
                      default=None, metavar="FIELDS",
                      help="resume although these fields changed (comma-separated: model, dtype, "
                           "image_size, batch_size, seed, app, data, lr, momentum, val_split, optimizer, "
                           "lr_schedule, augment, class_weights, classes, or all)")
    add_training_args(parser)
    add_task_args(parser)
    add_evaluation_args(parser)
    return parser


def add_evaluation_args(parser: argparse.ArgumentParser, training: bool = True) -> None:
    """Held-out data flags (and, for ``train``, when to evaluate and where to log metrics)."""
    g = parser.add_argument_group("evaluation")
    g.add_argument("--val-fraction", dest="val_fraction", type=float, default=None, metavar="F",
                   help="hold out this share of each class (seeded by --seed, stratified) for validation")
    g.add_argument("--val-datapath", dest="val_datapath", default=None, metavar="DIR",
                   help="validation images from another folder/slide(s) (same layout as --datapath)")
    if not training:
        return
    g.add_argument("--eval-every", dest="eval_every", type=int, default=0, metavar="N",
                   help="evaluate every N steps (always at each epoch end and at the end of the run)")
    g.add_argument("--log-dir", dest="log_dir", default=None, metavar="DIR",
                   help="write metrics.jsonl (one line per step and per evaluation) and, with "
                        "tensorboard installed, TensorBoard events here")


def run_record(args: argparse.Namespace, cfg: ParallelConfig) -> RunRecord:
    """What the run is, as checkpoints store it and the JSON summary begins (its identity and how it trains
    come with the data)."""
    data = DataRecord(AppKind.parse(args.app), args.image_size, args.batch_size, args.dtype,
                      None if args.datapath is None else str(args.datapath), args.val_fraction, args.val_datapath,
                      getattr(args, "class_names", None))
    return RunRecord(model_spec(args), data, seed=args.seed, config=cfg.as_dict(), task=task_of(args),
                     segmentation=segmentation_record(args))


# flag, attribute, least value, largest value (None: unbounded), whether the least is allowed
NUMERIC_FLAGS: tuple[tuple[str, str, float, float | None, bool], ...] = (
    ("--batch-size", "batch_size", 1, None, True),
    ("--image-size", "image_size", 1, None, True),
    ("--num-epochs", "num_epochs", 1, None, True),
    ("--num-classes", "num_classes", 1, None, True),
    ("--num-layers", "num_layers", 1, None, True),
    ("--num-filters", "num_filters", 1, None, True),
    ("--num-samples", "num_samples", 1, None, True),
    ("--steps", "steps", 1, None, True),
    ("--seed", "seed", 0, None, True),
    ("--slide-level", "slide_level", 0, None, True),
    ("--min-tissue", "min_tissue", 0, 1, True),
    ("--lr", "lr", 0, None, False),
    ("--momentum", "momentum", 0, 1, True),
    ("--weight-decay", "weight_decay", 0, None, True),
    ("--lr-gamma", "lr_gamma", 0, 1, False),
    ("--lr-step-size", "lr_step_size", 1, None, True),
    ("--keep-checkpoints", "keep_checkpoints", 1, None, True),
    ("--checkpoint-every", "checkpoint_every", 0, None, True),
    ("--step-timeout", "step_timeout", 0, None, True),
    ("--eval-every", "eval_every", 0, None, True),
)


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag in its range (finite), else ConfigError naming the flag and the range."""
    for flag, name, least, most, closed in NUMERIC_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        low_ok = value >= least if closed else value > least
        if not math.isfinite(value) or not low_ok or (most is not None and value > most):
            bound = f"{'>=' if closed else '>'} {least:g}" + (f" and <= {most:g}" if most is not None else "")
            raise ConfigError(flag, f"must be a number {bound}, got {value:g}")


def check_run_args(args: argparse.Namespace) -> None:
    """Errors in the non-parallel flags, naming the flag and what works (before any rank talks)."""
    check_numbers(args)
    check_task_args(args)
    if args.datapath is not None and not AppKind.parse(args.app).reads_datapath:
        raise ConfigError("--datapath", f"--app {args.app} does not read --datapath (it would train on "
                          f"generated images); use --app medical for tiles/slides or --app cifar for "
                          f"CIFAR-10 batches, or drop --datapath")
    check_device_flags(args)
    check_model_flags(args)
    check_resolution_flags(args)
    if args.resume == "latest" and args.checkpoint_dir is None:
        raise ConfigError("--resume", "'latest' looks in --checkpoint-dir; give --checkpoint-dir "
                          "or a checkpoint path")
    if args.resume not in (None, "latest") and not Path(args.resume).expanduser().exists():
        raise ConfigError("--resume", f"{args.resume!r}: no such checkpoint file or directory")
    parse_allowed(args.allow_config_change)
    check_evaluation_args(args)
    check_training_args(args)
    check_keep_best(args)
    check_task_classes(args)


def check_evaluation_args(args: argparse.Namespace) -> None:
    """--val-fraction in (0, 1), not together with --val-datapath; --eval-every/--log-dir need held-out data."""
    fraction = getattr(args, "val_fraction", None)
    if fraction is not None and not (0.0 < fraction < 1.0):
        raise ConfigError("--val-fraction", f"must lie strictly between 0 and 1, got {fraction:g}")
    if fraction is not None and args.val_datapath is not None:
        raise ConfigError("--val-fraction", "give --val-fraction (held out of --datapath) or --val-datapath "
                          "(another folder), not both")
    if args.val_datapath is not None and args.app is not None and not AppKind.parse(args.app).reads_datapath:
        raise ConfigError("--val-datapath", f"--app {args.app} reads no files; use --val-fraction")
    if getattr(args, "eval_every", 0) and fraction is None and args.val_datapath is None:
        raise ConfigError("--eval-every", "needs validation data: add --val-fraction F or --val-datapath DIR")


def say_once(ctx: Comm, text: str, command: str = "train") -> None:
    """A message about the whole job, from rank 0, named after the ``command`` that says it."""
    if ctx.rank == 0:
        print(f"mpi4dl_nb {command}: {text}", file=sys.stderr, flush=True)


def agree_or_exit(ctx: Comm, error: BaseException | None, command: str = "train") -> None:
    """All ranks learn whether any rank failed in set-up; rank 0 says why once (as ``command``);
    all exit together (code 2)."""
    messages = ctx.all_gather_object(None if error is None else f"{error}")
    failed: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message is not None:
            failed.setdefault(message, []).append(rank)
    if not failed:
        return
    if len(failed) == 1 and next(iter(failed.values())) in (list(range(len(messages))), [0]):
        say_once(ctx, f"error: {next(iter(failed))}", command)     # every rank, or a rank-0 check
    else:
        for message, ranks in failed.items():
            where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            say_once(ctx, f"error on {where}: {message}", command)
    raise SystemExit(EXIT_SETUP)


def agreed(ctx: Comm, action: Callable[[], object], command: str = "train") -> None:
    """Run a set-up ``action`` on every rank; an input error on any rank stops all (see agree_or_exit)."""
    error = None
    try:
        action()
    except SETUP_ERRORS as err:
        error = err
    agree_or_exit(ctx, error, command)


def model_fingerprint(spec: ModelSpec, layers: Sequence[nn.Module]) -> str:
    """The model part of the run identity: its spec and a hash of every tensor's name, shape and dtype
    (the text checkpoints on disk compare against: keep it as it is)."""
    from ..run.identity import digest

    shapes = [(f"{i}.{k}", list(v.shape), str(v.dtype)) for i, layer in enumerate(layers)
              for k, v in layer.state_dict().items()]
    if spec.family.named:
        return f"{spec.label}, {spec.num_classes} classes [{digest(shapes)}]"
    version = f" v{spec.resnet_version}" if spec.resnet_version else ""
    return (f"{spec.family}{version}, {spec.num_layers} layers, {spec.num_filters} filters, "
            f"{spec.num_classes} classes [{digest(shapes)}]")


class Setup:
    """Everything a run needs, built before any training collective, in agreed stages."""

    def __init__(self, args: argparse.Namespace, cfg: ParallelConfig, ctx: Comm) -> None:
        self.args = args
        self.cfg = cfg
        self.ctx = ctx
        self.record = run_record(args, cfg)
        self.layers: list[nn.Module] = []
        self.batcher: Batcher | None = None
        self.val_dataset: RegionDataset | None = None
        self.held_out: str = "none"
        self.steps = 0
        self.identity: dict[str, object] = {}
        self.allowed = parse_allowed(args.allow_config_change)
        self.selection: Selection | None = None
        self.run_id: str | None = None

    def build_model(self) -> None:
        """The model, the configuration against it, and (rank 0) the checkpoint directory."""
        import torch

        from ..run.checkpoint_space import estimate_checkpoint_bytes, prepare_directory
        from .setup import check_layout

        args = self.args
        self.dtype = getattr(torch, args.dtype)
        torch.manual_seed(args.seed)
        self.layers = self.record.model.build(args.image_size)
        if args.weights is not None:
            from ..models.weights import load_weights, read_weights

            note = load_weights(self.layers, read_weights(args.weights), model=self.record.model.label)
            if note is not None:
                say_once(self.ctx, note)
        for layer in self.layers:
            layer.to(self.dtype)
        check_layout(self.cfg, self.layers, args.batch_size, args.image_size)
        if args.log_dir is not None and self.ctx.rank == 0:
            check_log_dir(args.log_dir)
        if args.checkpoint_dir is not None and self.ctx.rank == 0:
            tensors = [t for layer in self.layers for t in layer.state_dict().values()]
            state = sum(t.numel() * t.element_size() for t in tensors)
            files = 2 if args.keep_best else 1        # the newest and the best one
            prepare_directory(args.checkpoint_dir, files * estimate_checkpoint_bytes(
                state, len(tensors), optimizer_spec(args).state_slots))

    def open_data(self, exclude: Sequence[Path] = (), exclude_held_out: Sequence[Path] = ()) -> None:
        """The dataset (without ``exclude``; --val-datapath without ``exclude_held_out``), refusing one-class
        data unless --num-classes 1."""
        from ..data import Batcher
        from ..data.classes import class_counts
        from ..data.resolution import dataset_mpp
        from ..data.validate import classes_found
        from .setup import dataset_from

        args = self.args
        dataset = dataset_from(args, args.datapath, exclude)
        self.record = replace(self.record, data=replace(self.record.data, mpp=dataset_mpp(dataset)))
        if dataset.num_classes > args.num_classes:
            raise ConfigError("--num-classes", f"the data has {dataset.num_classes} classes; use "
                              f"--num-classes {dataset.num_classes}")
        if classes_found(dataset) == 1 and args.num_classes != 1:
            raise ConfigError("--datapath", f"{args.datapath} holds one class only (files directly in "
                              f"the folder, or a single slide), so every label would be 0; put each "
                              f"class in its own sub-folder (<datapath>/<class>/...), or pass "
                              f"--num-classes 1 to train on one class anyway")
        train, self.val_dataset, self.held_out = held_out_data(args, dataset, exclude_held_out)
        steps = args.steps if args.steps is not None else args.num_epochs * (len(train) // args.batch_size)
        pixels = label_counts(args, train)      # segmentation: pixels per class (None: count images)
        training = training_record(args, steps, class_counts(train, args.num_classes) if pixels is None else pixels)
        training.augment.check_channels(train.channels)
        self.record = replace(self.record, training=training)
        self.batcher = Batcher(train, args.batch_size, seed=args.seed, augment=training.augment)
        self.steps = steps
        if self.ctx.rank == 0:
            self.identity = self.make_identity(dataset)

    def make_identity(self, dataset: RegionDataset) -> dict[str, object]:
        from ..data.validate import fingerprint
        from ..run.identity import digest

        args = self.args
        data = fingerprint(dataset)
        text = f"{data['kind']}, {len(dataset)} images [{digest(data)}]"
        training = self.record.training
        assert training is not None, "open_data made the training record"
        weights = training.class_weights
        return {"model": model_fingerprint(self.record.model, self.layers), "dtype": args.dtype,
                "image_size": args.image_size, "batch_size": args.batch_size, "seed": args.seed,
                "app": str(args.app), "data": text, "lr": args.lr, "momentum": training.optimizer.momentum,
                "val_split": self.held_out, "optimizer": training.optimizer.describe(),
                "lr_schedule": training.schedule.describe(), "augment": training.augment.describe(),
                "class_weights": "none" if weights is None else ",".join(f"{w:.6g}" for w in weights),
                "classes": ",".join(self.record.class_names), **task_identity(args)}

    def choose_resume(self) -> None:
        """Rank 0: the checkpoint to resume from (checked against this run) and the lineage to continue."""
        from ..checkpoint.files import list_checkpoints, new_run_id
        from ..run.identity import RunIdentity, describe_changes
        from ..run.resume import select_resume

        args = self.args
        if self.ctx.rank != 0:
            return
        current = RunIdentity(self.identity)
        if args.resume is None:
            self.run_id = new_run_id()
            return

        def accept(saved: Mapping[str, object]) -> str | None:
            other_task = task_mismatch(saved_task(saved), task_of(args))
            if other_task is not None:
                return other_task
            refused = current.refused_changes(RunIdentity.from_dict(saved), self.allowed)
            if not refused:
                return None
            return (f"another configuration: {describe_changes(refused)}; pass --allow-config-change "
                    f"{','.join(c.name for c in refused)} to resume it anyway")
        selection = select_resume(args.resume, args.checkpoint_dir, accept)
        saved = selection.checkpoint.record
        step = saved.step
        if step > self.steps:
            raise ConfigError("--steps", f"the checkpoint is at step {step}, past --steps "
                              f"{self.steps}; use --steps >= {step}")
        changed = current.changes_from(RunIdentity.from_dict(saved.identity))
        lineage = saved.run_id
        if args.checkpoint_dir is not None and lineage is not None:
            ahead = [e for e in list_checkpoints(args.checkpoint_dir)
                     if e.run_id == lineage and e.step > step]
            if ahead:   # resuming an older checkpoint forks: the newer ones are never rotated away
                lineage = None
        self.run_id = lineage if lineage and not changed else new_run_id()
        self.selection = selection
        if changed:
            say_once(self.ctx, f"resuming with {describe_changes(changed)} (--allow-config-change); "
                               f"the run no longer equals an uninterrupted one")
        if selection.skipped or args.verbose:
            say_once(self.ctx, selection.report())


def check_log_dir(path: str) -> None:
    """--log-dir: a directory rank 0 can create and write in (checked before the first step)."""
    import os

    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError("--log-dir", f"cannot create {path}: {err}") from err
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError("--log-dir", f"{path} is not a writable directory; choose another --log-dir")


def held_out_data(args: argparse.Namespace, dataset: RegionDataset,
                  exclude: Sequence[Path] = ()) -> tuple[RegionDataset, RegionDataset | None, str]:
    """(training set, validation set or None, the split's identity text) for --val-fraction/--val-datapath
    (without the files ``exclude``)."""
    from ..data.pathology import require_path
    from ..evaluation.split import Subset, split_listing, stratified_split
    from ..run.identity import digest
    from .setup import dataset_from

    if args.val_fraction is not None:
        labels = [dataset.label(i) for i in range(len(dataset))]
        dense = task_of(args).dense       # masks: images are not split by class (every label 0)
        train, val = stratified_split(labels, args.val_fraction, args.seed, 1 if dense else args.num_classes)
        text = (f"fraction {args.val_fraction:g}, seed {args.seed}, {len(val)} images "
                f"[{digest(split_listing(dataset, val))}]")
        return Subset(dataset, train), Subset(dataset, val), text
    if args.val_datapath is not None:
        require_path(args.val_datapath, "--val-datapath")
        held = dataset_from(args, args.val_datapath, exclude)
        if len(held) < args.num_classes and not task_of(args).dense:
            raise ConfigError("--val-datapath", f"{args.val_datapath} holds {len(held)} images, fewer than "
                              f"the {args.num_classes} classes")
        text = (f"--val-datapath {Path(args.val_datapath).name}, {len(held)} images "
                f"[{digest(split_listing(held, range(len(held))))}]")
        return dataset, held, text
    return dataset, None, "none"


def check_data_or_exit(setup: Setup, ctx: Comm) -> tuple[list[Path], list[Path]]:
    """The data check of --datapath, then --val-datapath (collective); exits with EXIT_SETUP on a missing
    path, or on bad files unless --skip-bad-files. Returns the files to leave out of each."""
    from ..run.data_check import DataRole

    args = setup.args
    return (check_one_or_exit(args, ctx, args.datapath, DataRole.TRAINING),
            check_one_or_exit(args, ctx, args.val_datapath, DataRole.VALIDATION))


def check_one_or_exit(args: argparse.Namespace, ctx: Comm, datapath: str | None, role: DataRole) -> list[Path]:
    """One path's data check: the files to skip (none), or exit with one message naming ``role``'s flag."""
    from ..run.data_check import check_data

    found: list[tuple[DataSources, Checker | None]] = []
    agreed(ctx, lambda: found.append(data_sources(args, datapath, role.flag)))
    sources, checker = found[0]
    report = check_data(ctx, sources, args.image_size, args.slide_level, progress=args.progress, checker=checker)
    if not report.bad:
        return []
    if not args.skip_bad_files or len(report.bad) == report.total:
        say_once(ctx, report.refusal(datapath or "", role))
        raise SystemExit(EXIT_SETUP)
    say_once(ctx, "warning: " + report.warning(role))
    return report.bad_paths


def prepare(args: argparse.Namespace, cfg: ParallelConfig, ctx: Comm) -> Setup:
    """Set-up in stages that every rank agrees on: model and checkpoint dir, data check, dataset, resume."""
    setup = Setup(args, cfg, ctx)
    agreed(ctx, setup.build_model)
    if args.checkpoint_dir is not None:           # every host must see it (collective)
        from ..run.checkpoint_space import require_shared

        agreed(ctx, lambda: require_shared(ctx, args.checkpoint_dir))
    bad, bad_held_out = check_data_or_exit(setup, ctx)
    agreed(ctx, lambda: setup.open_data(bad, bad_held_out))
    agreed(ctx, setup.choose_resume)
    return setup


def build_trainer(setup: Setup, monitor: JobMonitor | None) -> Trainer:
    """The engine (optimizer, loss), evaluator and Trainer of a prepared run, as the flags name them (collective)."""
    from ..pipeline.engine import HybridEngine
    from ..run.divergence import NonFiniteGuard, watch
    from ..run.loss import classification_loss
    from ..run.trainer import Trainer, TrainSettings
    from .segmentation_flags import dense_loss

    args, cfg, ctx, training = setup.args, setup.cfg, setup.ctx, setup.record.training
    assert setup.batcher is not None and training is not None, "prepare opened the data"
    dense = task_of(args).dense
    loss = watch(dense_loss(setup.record) if dense else classification_loss(training.class_weights))
    engine = HybridEngine(setup.layers, cfg, ctx, loss_fn=loss, abort_on_error=False, image_size=args.image_size,
                          optimizer=training.optimizer.build)
    guard = NonFiniteGuard(engine, ctx, loss, OnNonFinite(args.on_nonfinite),
                           hint="Lower --lr, or pass --on-nonfinite skip-step to skip such steps.")
    settings = TrainSettings(steps=setup.steps,
                             checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
                             checkpoint_every=args.checkpoint_every,
                             keep_checkpoints=args.keep_checkpoints, progress=args.progress,
                             verbose=args.verbose, dtype=setup.dtype,
                             step_timeout=args.step_timeout, auto_step_timeout=args.step_timeout is None,
                             eval_every=args.eval_every, lr_schedule=training.schedule,
                             keep_best=MetricName(args.keep_best) if args.keep_best else None, task=task_of(args))
    run_id = ctx.bcast_object(setup.run_id, root=0)
    evaluator: Evaluator | SegmentationEvaluator | None = None
    if setup.val_dataset is not None and dense:
        from .segmentation_flags import evaluator as segmentation_evaluator

        evaluator = segmentation_evaluator(engine, setup.val_dataset, ctx, args.batch_size, setup.record, setup.dtype)
    elif setup.val_dataset is not None:
        from ..evaluation.evaluator import Evaluator

        evaluator = Evaluator(engine, setup.val_dataset, ctx, args.batch_size, setup.dtype,
                              classes=setup.record.class_names)
    return Trainer(engine, setup.batcher, ctx, settings, replace(setup.record, identity=setup.identity),
                   run_id=run_id, monitor=monitor, guard=guard, evaluator=evaluator)


def run_job(args: argparse.Namespace, cfg: ParallelConfig, ctx: Comm, monitor: JobMonitor) -> int:
    """Set up, train, print the JSON summary on rank 0; a divergence or a failed save stops every rank together."""
    from ..run.divergence import NonFiniteError
    from ..run.trainer import EXIT_CHECKPOINT, CheckpointWriteError

    setup = prepare(args, cfg, ctx)
    trainer = build_trainer(setup, monitor)
    if args.resume is not None:
        step = trainer.restore(setup.selection.checkpoint if setup.selection is not None else None)
        if step >= setup.steps:
            say_once(ctx, f"the checkpoint is at step {step} = --steps: nothing to train")
    if args.log_dir is not None and ctx.rank == 0:
        from ..evaluation.log import MetricsLog

        trainer.log = MetricsLog(args.log_dir, trainer.run_id, start_step=trainer.step)
        if trainer.log.moved_aside is not None:
            say_once(ctx, f"{args.log_dir}: the earlier metrics.jsonl is now {trainer.log.moved_aside.name}")
    try:
        summary = trainer.run()
    except NonFiniteError as err:
        say_once(ctx, f"stopped: {err} The last good checkpoint: {trainer.last_checkpoint or 'none written'}")
        return EXIT_NONFINITE
    except CheckpointWriteError as err:
        say_once(ctx, f"stopped: {err}")
        return EXIT_CHECKPOINT
    if summary is not None:
        if args.verbose:
            print(summary.report(), file=sys.stderr, flush=True)
        print(summary.to_json(), flush=True)
    return 0


def train_main(args: argparse.Namespace, cfg: ParallelConfig) -> int:
    """Start MPI and the job monitor, run the job; any other failure ends the job with one message."""
    from ..comm.context import init
    from ..run.monitor import EXIT_FAILED, JobMonitor

    ctx = init(backend=args.backend, device=args.device)
    errors_to = args.log_dir or args.checkpoint_dir      # tracebacks: the run's directory, else the temporary one
    monitor = JobMonitor.start(ctx, verbose=args.verbose, log_dir=Path(errors_to) if errors_to else None)
    try:
        code = run_job(args, cfg, ctx, monitor)
    except SystemExit:
        monitor.close()
        raise
    except BaseException as err:
        monitor.fail(err)        # with several ranks: one message for the job, then abort
        return EXIT_FAILED
    monitor.close()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb train``."""
    from .setup import parse_launch

    args, cfg = parse_launch(build_parser(), argv, check_run_args)
    return train_main(args, cfg)
