"""The one builder of a TrainJob: from ``train``'s checked flags, or from Python keyword arguments named like them
(``dl.train(model="resnet", num_layers=8, ...)``: the same defaults, checks and job)."""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from difflib import get_close_matches
from pathlib import Path

from ..config import ConfigError, ParallelConfig
from ..data.apps import AppKind
from ..data.augment import AugmentSpec
from ..data.classes import parse_class_weights
from ..evaluation.metrics import MetricName
from ..pipeline.optim import LRScheduleKind
from ..run.divergence import OnNonFinite
from ..run.identity import parse_allowed
from ..run.job import CheckpointSpec, DataSpec, HeldOutSpec, RunOptions, TrainingSpec, TrainJob
from ..run.summary import TrainSummary
from ..spatial.loss import LossKind
from .args import config_from_args
from .model_flags import model_spec
from .resolution_flags import resolution_of
from .segmentation_flags import task_of
from .train_flags import build_parser, check_run_args
from .training_flags import optimizer_spec
from .volume_flags import is_volume_run


def train_job(args: argparse.Namespace, cfg: ParallelConfig) -> TrainJob:
    """The job ``train``'s flags name, after ``check_run_args`` (which resolves the classes): a line per flag."""
    mpp, source_mpp = resolution_of(args)
    model = model_spec(args)
    return TrainJob(
        config=cfg,
        model=model,
        data=DataSpec(app=AppKind.parse(args.app), datapath=text_of(args.datapath),
                      image_size=max(args.image_size) if is_volume_run(args) else args.image_size,
                      volume_size=args.image_size if is_volume_run(args) else None,
                      num_samples=args.num_samples, slide_level=args.slide_level, min_tissue=args.min_tissue,
                      mpp=mpp, source_mpp=source_mpp, voxel_size=args.voxel_size, num_classes=args.num_classes,
                      class_names=tuple(args.class_names), class_order=args.class_order, task=task_of(args),
                      ignore_index=args.ignore_index, skip_bad_files=args.skip_bad_files,
                      cohort=args.cohort_data, whole_slide=args.whole_slide, stain_request=args.stain_request,
                      tissue_channel=args.whole_slide and model.pool.tissue),
        training=TrainingSpec(batch_size=args.batch_size, steps=args.steps, num_epochs=args.num_epochs,
                              seed=args.seed, dtype=args.dtype, optimizer=optimizer_spec(args),
                              lr_schedule=LRScheduleKind(args.lr_schedule), warmup_steps=args.warmup_steps,
                              lr_step_size=args.lr_step_size, lr_gamma=args.lr_gamma,
                              class_weights=parse_class_weights(args.class_weights),
                              augment=AugmentSpec.parse(args.augment), loss=LossKind(args.loss),
                              accumulate=args.accumulate),
        held_out=HeldOutSpec(val_fraction=args.val_fraction, val_datapath=text_of(args.val_datapath),
                             eval_every=args.eval_every, log_dir=text_of(args.log_dir),
                             group_by=args.group_by, folds=args.folds, fold=args.fold),
        checkpoints=CheckpointSpec(directory=text_of(args.checkpoint_dir), every=args.checkpoint_every,
                                   keep=args.keep_checkpoints,
                                   keep_best=None if args.keep_best is None else MetricName(args.keep_best),
                                   resume=text_of(args.resume), allow_config_change=parse_allowed(
                                       args.allow_config_change)),
        options=RunOptions(backend=args.backend, device=args.device, progress=args.progress, verbose=args.verbose,
                           on_nonfinite=OnNonFinite(args.on_nonfinite), step_timeout=args.step_timeout))


def text_of(path: str | Path | None) -> str | None:
    """A path given as text or as a Path, as the job keeps it."""
    return None if path is None else str(path)


def checked_job(args: argparse.Namespace) -> TrainJob:
    """The job of parsed flags: checked (ConfigError naming the flag), classes resolved, built."""
    cfg = config_from_args(args)
    check_run_args(args)
    return train_job(args, cfg)


def flags_of(parser: argparse.ArgumentParser, keywords: Mapping[str, object]) -> argparse.Namespace:
    """``parser``'s defaults with ``keywords`` (named like the flags' destinations) in their place: text converted
    as the flag converts it, choices checked; ConfigError naming an unknown keyword and the closest ones."""
    args = parser.parse_args([])
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    for name, value in keywords.items():
        action = actions.get(name)
        if action is None:
            close = get_close_matches(name, actions, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(name, f"is not a setting of train{hint}")
        if isinstance(value, str) and callable(action.type):
            value = action.type(value)
        if isinstance(value, str) and isinstance(action, argparse._AppendAction):
            value = [value]
        if action.choices is not None and value is not None and value not in action.choices:
            raise ConfigError(name, f"{value!r}: choose one of {', '.join(map(str, action.choices))}")
        setattr(args, name, value)
    return args


def job_from_keywords(**keywords: object) -> TrainJob:
    """The job ``train`` would run for the flags these keyword arguments name (``num_layers=8`` for
    ``--num-layers 8``): the same defaults, checks and builder."""
    return checked_job(flags_of(build_parser(), keywords))


def train(**keywords: object) -> TrainSummary | None:
    """``dl.train``: run ``train`` from Python on every rank of the job (collective): the keyword arguments name its
    flags (``model="resnet", num_layers=8, val_fraction=0.25, checkpoint_dir="ckpt"``); returns the TrainSummary on
    rank 0 (None elsewhere). ConfigError for a setting refused before any rank talks, SetupFailed (every rank, one
    message) for a set-up refused on some rank."""
    from ..comm.context import init
    from ..run.job_run import run_job

    job = job_from_keywords(**keywords)
    ctx = init(backend=job.options.backend, device=job.options.device)
    job.config.validate(world_size=ctx.world_size)
    return run_job(job, ctx)
