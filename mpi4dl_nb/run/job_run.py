"""A TrainPlan turned into its run, the same from the command line and ``dl.train``: the model, checkpoint directory,
data check, dataset and held-out split, record and identity, resume, run id, then engine, evaluator and Trainer."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.record import RunRecord
from ..comm.agreement import SetupFailed, agreed
from ..config import ConfigError
from ..console import SetupLines, to_stderr
from ..data.canvas import SlideCanvases
from ..data.pathology import TileFolderDataset
from .job import TrainJob, TrainPlan, data_text

if TYPE_CHECKING:
    from torch import nn

    from ..comm.protocol import Comm
    from ..data.dataset import Batcher, RegionDataset
    from ..evaluation.grouped import GroupedSplit
    from ..pipeline.layer_decay import OptimizerFactory
    from ..pipeline.optim import OptimizerSpec
    from .data_check import DataRole
    from .monitor import JobMonitor
    from .resume import Selection
    from .summary import TrainSummary
    from .trainer import Trainer

COMMAND = "train"


def say_once(ctx: Comm, text: str) -> None:
    """A message about the whole job, from rank 0."""
    if ctx.rank == 0:
        to_stderr(f"mpi4dl_nb {COMMAND}: {text}")


class JobSetup:
    """Everything a run needs, built before any training collective, in stages every rank agrees on."""

    def __init__(self, job: TrainPlan, ctx: Comm) -> None:
        self.job = job
        self.ctx = ctx
        self.record: RunRecord = volume_record(job.record(), job)
        self.layers: list[nn.Module] = []
        self.batcher: Batcher | None = None
        self.val_dataset: RegionDataset | None = None
        self.held_out: str = "none"
        self.steps = 0
        self.identity: dict[str, object] = {}
        self.selection: Selection | None = None
        self.run_id: str | None = None
        self.lr_scales: dict[str, float] | None = None     # --layer-decay: each parameter's rate scale by key

    def build_model(self) -> None:
        """The model, the configuration against it, and (rank 0) the log and checkpoint directories."""
        import torch

        from ..pipeline.stage_draws import check_draws
        from .checkpoint_space import estimate_checkpoint_bytes, prepare_directory
        from .trainer import check_layout

        job = self.job
        torch.manual_seed(job.training.seed)
        spec, size = self.record.model, job.data.volume_size or job.data.image_size
        if job.model.weights is not None:     # checked against the model built on the meta device, then loaded
            from ..models.weights import check_weights_fit, load_weights, read_weights

            weights = read_weights(job.model.weights)
            check_weights_fit(lambda: spec.build(size, adapters=False), weights, model=spec.label)
        self.layers = spec.build(size, adapters=False)
        if job.model.weights is not None:
            note = load_weights(self.layers, weights, model=spec.label)
            if note is not None:
                say_once(self.ctx, note)
        if job.asked is not None and job.model.family.named:          # the normalisation applied, and whence
            say_once(self.ctx, job.asked.model.normalization_line())
        card = self.record.model.preprocessing          # a preset's: --normalize over the card's said in one line
        override = None if card is None else card.override_note(self.record.model.normalize)
        if override is not None:
            say_once(self.ctx, override)
        adapted = self.record.model.with_adapters(self.layers)      # --lora-rank: after the weights they adapt
        if adapted is not None:
            say_once(self.ctx, adapted)
        self.freeze_blocks()
        decay = job.training.optimizer.layer_decay
        if decay is not None:
            from ..models.vit import layer_decay_scales

            self.lr_scales = layer_decay_scales(self.layers, decay, self.record.model.label)
        for layer in self.layers:
            layer.to(job.training.torch_dtype)
        check_layout(job.config, self.layers, job.training.batch_size, job.data.volume_size or job.data.image_size)
        check_draws(self.layers, job.config, job.data.image_size if job.data.volume_size is None else None)
        self.say_zero_share()
        if job.held_out.log_dir is not None and self.ctx.rank == 0:
            check_log_dir(job.held_out.log_dir)
        directory = job.checkpoints.directory
        if directory is not None and self.ctx.rank == 0:
            tensors = [t for layer in self.layers for t in layer.state_dict().values()]
            state = sum(t.numel() * t.element_size() for t in tensors)
            files = 2 if job.checkpoints.keep_best else 1        # the newest and the best one
            prepare_directory(directory, files * estimate_checkpoint_bytes(
                state, len(tensors), job.training.optimizer.spec.state_slots))

    def say_zero_share(self) -> None:
        """``--zero-stage``: the line saying what it shards, when that is little or nothing (rank 0)."""
        from .zero_share import stage_shares, zero_note

        cfg, data = self.job.config, self.job.data
        note = zero_note(cfg, stage_shares(cfg, self.layers, data.volume_size or data.image_size)) \
            if cfg.zero_stage and self.ctx.rank == 0 else None
        if note is not None:
            say_once(self.ctx, note)

    def freeze_blocks(self) -> None:
        """``--train-blocks K``: a ViT's blocks but the last K frozen (the line saying so printed once); what a cut
        ViT cannot run on its spatial stage refused before work."""
        from ..models.vit import refuse_token_spatial_stage, train_last_blocks

        job = self.job
        refuse_token_spatial_stage(self.layers, job.config, job.data.image_size)
        spec = self.record.model
        if spec.train_blocks is not None:
            say_once(self.ctx, train_last_blocks(self.layers, spec.train_blocks, spec.label))

    def open_data(self, exclude: Sequence[Path] = (), exclude_held_out: Sequence[Path] = ()) -> None:
        """The dataset (without ``exclude``; the held-out folder without ``exclude_held_out``), its split, the
        training record; refusing one-class data unless one class is asked for."""
        from ..data import Batcher
        from ..data.classes import class_counts
        from ..data.resolution import dataset_mpp
        from ..data.validate import classes_found
        from .job_data import VOLUME_FOLDERS, balanced_order, dataset_from, held_out_data, label_counts

        job, data, training = self.job, self.job.data, self.job.training
        dataset = dataset_from(data, training.seed, data.datapath, exclude)
        if isinstance(dataset, VOLUME_FOLDERS) and dataset.orientation_note:
            say_once(self.ctx, dataset.orientation_note)
        cropped = dataset.crop_note() if isinstance(dataset, TileFolderDataset) and self.ctx.rank == 0 else None
        if cropped is not None:                 # a larger image's centre crop is never silent
            say_once(self.ctx, cropped)
        self.record = replace(self.record, data=replace(self.record.data, mpp=dataset_mpp(dataset)))
        if isinstance(dataset, SlideCanvases):
            self.record_canvases(dataset)
        if dataset.num_classes > data.num_classes:
            raise ConfigError("--num-classes", f"the data has {dataset.num_classes} classes; use "
                              f"--num-classes {dataset.num_classes}")
        if classes_found(dataset) == 1 and data.num_classes != 1:
            raise ConfigError("--datapath", f"{data.datapath} holds one class only (files directly in "
                              f"the folder, or a single slide), so every label would be 0; put each "
                              f"class in its own sub-folder (<datapath>/<class>/...), or pass "
                              f"--num-classes 1 to train on one class anyway")
        train, self.val_dataset, self.held_out, split = held_out_data(data, job.held_out, training.seed, dataset,
                                                                      exclude_held_out)
        if split is not None:
            self.record_split(split, dataset)
        steps = training.steps if training.steps is not None else max(1, (
            training.num_epochs * (len(train) // training.batch_size)) // training.accumulate)
        pixels = label_counts(data, training.class_weights, train)   # segmentation: pixels per class
        counted = class_counts(train, data.num_classes) if pixels is None else pixels
        self.record = replace(self.record, training=training.record(steps, counted))
        training.augment.check_channels(train.channels)
        from ..models.canvas import check_tissue_input

        check_tissue_input(job.model.pool, job.model.in_channels, train.channels)
        balanced = balanced_order(train, split, job.held_out.group_by) if training.balanced_sampler else None
        self.batcher = Batcher(train, training.batch_size, seed=training.seed, augment=training.augment,
                               balanced=balanced)
        self.steps = steps
        if self.ctx.rank == 0:
            self.identity = self.make_identity(dataset)

    def record_canvases(self, canvases: SlideCanvases) -> None:
        """The canvas checked against the layout (tiles of whole trunk strides); each slide's canvas into the record; a
        line per slide printed, and a note on one canvas per batch under an averaging pool (rank 0)."""
        from ..models.canvas import check_canvas, single_canvas_note
        from ..spatial.geometry import TileGrid

        config, model = self.job.config, self.job.model
        if config.spatial_size > 0:
            check_canvas(canvases.image_size, TileGrid(*config.grid_shape), model.image_multiple)
        self.record = replace(self.record, data=replace(self.record.data, canvases=tuple(canvases.placements)))
        say_once(self.ctx, "whole-slide canvases:\n  " + "\n  ".join(canvases.report()))
        note = single_canvas_note(model.pool, self.job.training.batch_size, self.layers)
        if note is not None:
            say_once(self.ctx, note)

    def record_split(self, split: GroupedSplit, dataset: RegionDataset) -> None:
        """The split's groups per side into the record; its counts printed (rank 0)."""
        from .job_data import split_record, volume_split_summary

        self.record = replace(self.record, split=split_record(split, self.job.held_out, self.job.training.seed))
        if self.job.data.volume_size is not None:
            say_once(self.ctx, volume_split_summary(split))
            return
        labels = [dataset.label(i) for i in range(len(dataset))]
        names = () if self.job.data.task.dense else self.record.class_names     # masks: labels are pixel values
        say_once(self.ctx, split.summary(labels, names))

    def make_identity(self, dataset: RegionDataset) -> dict[str, object]:
        """The fields a resume compares (``run/identity.py``)."""
        from ..data.validate import dataset_fingerprint
        from .identity import FLAGS, digest, identity_flags, model_fingerprint

        job, training = self.job, self.record.training
        assert training is not None, "open_data made the training record"
        found = dataset_fingerprint(dataset)
        text = f"{found['kind']}, {len(dataset)} images [{digest(found)}]"
        weights = training.class_weights
        return {"model": model_fingerprint(self.record.model, self.layers), "dtype": job.training.dtype,
                "image_size": self.record.data.size_text if job.data.volume_size else job.data.image_size,
                "batch_size": job.training.batch_size, "seed": job.training.seed,
                "app": str(job.data.app), "data": text, "lr": job.training.optimizer.lr,
                "stain": "none" if job.data.stain is None else job.data.stain.describe(),
                "momentum": training.optimizer.momentum,
                "val_split": self.held_out, "optimizer": training.optimizer.describe(),
                "lr_schedule": training.schedule.describe(), "augment": training.augment.describe(),
                "class_weights": "none" if weights is None else ",".join(f"{w:.6g}" for w in weights),
                "pool": str(job.model.pool), "accumulate": job.training.accumulate,
                "clip_grad_norm": job.training.clip_grad_norm,
                "sampler": "balanced" if job.training.balanced_sampler else "shuffled",
                "classes": ",".join(self.record.class_names), **job.task_identity(),
                FLAGS: identity_flags(self.record.model, training.optimizer)}

    def choose_resume(self) -> None:
        """Rank 0: the checkpoint to resume from (checked against this run) and the lineage to continue."""
        from ..checkpoint.files import new_run_id
        from .identity import RunIdentity, describe_changes, saved_task, task_mismatch
        from .resume import select_resume

        checkpoints = self.job.checkpoints
        if self.ctx.rank != 0:
            return
        current = RunIdentity(self.identity)
        if checkpoints.resume is None:
            self.run_id = new_run_id()
            return

        def accept(saved: Mapping[str, object]) -> str | None:
            other_task = task_mismatch(saved_task(saved), self.job.data.task)
            if other_task is not None:
                return other_task
            refused = current.refused_changes(RunIdentity.from_dict(saved), checkpoints.allowed_changes)
            if not refused:
                return None
            return (f"another configuration: {describe_changes(refused)}; pass --allow-config-change "
                    f"{','.join(c.name for c in refused)} to resume it anyway")
        selection = select_resume(checkpoints.resume, checkpoints.directory, accept)
        self.selection = selection
        self.continue_lineage(selection, current)

    def continue_lineage(self, selection: Selection, current: object) -> None:
        """Rank 0: the run id of a resumed run (its checkpoint's lineage, unless it forks or changed)."""
        from ..checkpoint.files import list_checkpoints, new_run_id
        from .identity import RunIdentity, describe_changes

        assert isinstance(current, RunIdentity)
        saved = selection.checkpoint.record
        step = saved.step
        if step > self.steps:
            raise ConfigError("--steps", f"the checkpoint is at step {step}, past --steps "
                              f"{self.steps}; use --steps >= {step}")
        changed = current.changes_from(RunIdentity.from_dict(saved.identity))
        lineage = saved.run_id
        directory = self.job.checkpoints.directory
        if directory is not None and lineage is not None:
            ahead = [e for e in list_checkpoints(directory) if e.run_id == lineage and e.step > step]
            if ahead:   # resuming an older checkpoint forks: the newer ones are never rotated away
                lineage = None
        self.run_id = lineage if lineage and not changed else new_run_id()
        if changed:
            say_once(self.ctx, f"resuming with {describe_changes(changed)} (--allow-config-change); "
                               f"the run no longer equals an uninterrupted one")
        if selection.skipped or self.job.options.verbose:
            say_once(self.ctx, selection.report())


def volume_record(record: RunRecord, job: TrainPlan) -> RunRecord:
    """``record`` with a volume run's patch (D, H, W), voxel size and tile grid (unchanged for images)."""
    data = job.data
    if data.volume_size is None:
        return record
    return replace(record, data=replace(record.data, volume_size=data.volume_size, voxel_size=data.voxel_size,
                                        volume_grid=job.config.volume_grid))


def check_log_dir(path: str) -> None:
    """--log-dir: a directory rank 0 can create and write in (checked before the first step; a folder made for the
    check is removed again, the metrics log makes it: a refused run leaves none)."""
    import os

    from .checkpoint_space import missing_folders, remove_made

    folder = Path(path)
    made = missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        remove_made(made)
        raise ConfigError("--log-dir", f"cannot create {path}: {err}") from err
    try:
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError("--log-dir", f"{path} is not a writable directory; choose another --log-dir")
    finally:
        remove_made(made)


def checked_files(job: TrainPlan, ctx: Comm, datapath: str | None, role: DataRole,
                  lines: SetupLines | None = None) -> list[Path]:
    """One path's data check (collective): the files to leave out (none), or SetupFailed naming ``role``'s flag
    (a missing path; bad files unless ``skip_bad_files``); ``lines`` say the check."""
    from .data_check import check_data
    from .job_data import data_sources

    sources, checker = agreed(ctx, lambda: data_sources(job.data, datapath, role.flag))
    if lines is not None and sources.kind is not None and sources.files:
        lines.doing(f"checking {len(sources.files)} {sources.kind.value} in {role.flag} {datapath}")
    size = 1 if job.data.whole_slide else job.data.image_size      # a canvas may be larger than its slide
    report = check_data(ctx, sources, size, job.data.slide_level, progress=job.options.progress, checker=checker)
    if not report.bad:
        return []
    if not job.data.skip_bad_files or len(report.bad) == report.total:
        raise SetupFailed(report.refusal(datapath or "", role))
    say_once(ctx, "warning: " + report.warning(role))
    return report.bad_paths


def fitted_stain(job: TrainPlan, ctx: Comm) -> TrainPlan:
    """``job`` with its stain normaliser fitted once, on rank 0, and broadcast (collective; unchanged without one)."""
    request = job.data.stain_request
    if request is None:
        return job
    fitted = ctx.bcast_object(agreed(ctx, lambda: request.fit() if ctx.rank == 0 else None), root=0)
    assert fitted is not None, "rank 0 fitted it (else every rank raised in agreed)"
    say_once(ctx, f"stain normalised: {fitted.describe()}")
    return replace(job, data=replace(job.data, stain=fitted))


def set_up_run(job: TrainPlan, ctx: Comm, lines: SetupLines | None = None) -> JobSetup:
    """Set-up in stages that every rank agrees on (SetupFailed on every rank otherwise): model and checkpoint
    directory, data check, dataset, resume; ``lines`` (the command's, rank 0) say each stage as it starts."""
    from .data_check import DataRole

    say = lines if lines is not None else SetupLines(COMMAND, False)
    if job.data.stain_request is not None:
        say.doing("fitting the stain normaliser")
    setup = JobSetup(fitted_stain(job, ctx), ctx)
    say.doing(f"building the model ({setup.record.model.label})")
    agreed(ctx, setup.build_model)
    if job.checkpoints.directory is not None:           # every host must see it (collective)
        from .checkpoint_space import require_shared

        directory = job.checkpoints.directory
        agreed(ctx, lambda: require_shared(ctx, directory))
    bad = checked_files(job, ctx, job.data.datapath, DataRole.TRAINING, say)
    bad_held_out = checked_files(job, ctx, job.held_out.val_datapath, DataRole.VALIDATION, say)
    say.doing(data_text(job.data))
    agreed(ctx, lambda: setup.open_data(bad, bad_held_out))
    if job.checkpoints.resume is not None:
        say.doing("choosing the checkpoint to resume")
    agreed(ctx, setup.choose_resume)
    from .checkpoint_space import write_run_config

    agreed(ctx, lambda: write_run_config(setup.job, ctx.rank, setup.run_id))     # rank 0: config.toml
    return setup


def optimizer_factory(spec: OptimizerSpec, lr_scales: Mapping[str, float] | None) -> OptimizerFactory:
    """The engine's optimizer factory: ``spec``'s, with a parameter group per rate scale under ``--layer-decay``
    (``lr_scales`` by whole-model key: ``models/vit.layer_decay_scales``)."""
    from ..pipeline.layer_decay import ScaledOptimizer

    return spec.build if lr_scales is None else ScaledOptimizer(spec, lr_scales)


def build_trainer(setup: JobSetup, monitor: JobMonitor | None) -> Trainer:
    """The engine (optimizer, the run's loss), evaluator and Trainer of a prepared run (collective)."""
    from ..pipeline.engine import HybridEngine
    from .divergence import NonFiniteGuard, watch
    from .held_out import evaluator_for, shared_run_id
    from .trainer import Trainer, TrainSettings

    job, ctx, training = setup.job, setup.ctx, setup.record.training
    assert setup.batcher is not None and training is not None, "prepare opened the data"
    loss = watch(setup.record.loss())
    engine = HybridEngine(setup.layers, job.config, ctx, loss_fn=loss, abort_on_error=False,
                          image_size=job.data.image_size if job.data.volume_size is None else None,
                          optimizer=optimizer_factory(training.optimizer, setup.lr_scales),
                          release_heap_every=job.options.release_heap_every,
                          max_grad_norm=job.training.clip_grad_norm)
    guard = NonFiniteGuard(engine, ctx, loss, job.options.on_nonfinite,
                           hint="Lower --lr, or pass --on-nonfinite skip-step to skip such steps.")
    checkpoints, options = job.checkpoints, job.options
    settings = TrainSettings(steps=setup.steps, checkpoint_dir=checkpoints.path, checkpoint_every=checkpoints.every,
                             keep_checkpoints=checkpoints.keep, progress=options.progress, verbose=options.verbose,
                             dtype=job.training.torch_dtype, step_timeout=options.step_timeout,
                             auto_step_timeout=options.step_timeout is None, eval_every=job.held_out.eval_every,
                             lr_schedule=training.schedule, keep_best=checkpoints.keep_best,
                             early_stop=checkpoints.early_stop, task=job.data.task,
                             accumulate=job.training.accumulate, read_ahead=options.read_ahead,
                             determinism=options.determinism)
    evaluator = None if setup.val_dataset is None else evaluator_for(
        engine, setup.val_dataset, ctx, job.training.batch_size, setup.record, settings.dtype, job.held_out.group_by)
    return Trainer(engine, setup.batcher, ctx, settings, replace(setup.record, identity=setup.identity),
                   run_id=shared_run_id(ctx, setup.run_id), monitor=monitor, guard=guard, evaluator=evaluator)


def started_trainer(job: TrainPlan, ctx: Comm, monitor: JobMonitor | None) -> Trainer:
    """The job's Trainer, set up (collective): restored from the checkpoint it resumes, its metrics log open; rank 0
    says each stage of the set-up as it starts (unless ``--no-progress``)."""
    lines = SetupLines(COMMAND, job.options.progress and ctx.rank == 0)
    setup = set_up_run(job, ctx, lines)
    lines.doing(f"building the engine on {ctx.world_size} rank{'s' if ctx.world_size > 1 else ''}")
    trainer = build_trainer(setup, monitor)
    if job.checkpoints.resume is not None:
        lines.doing("restoring the checkpoint")
        step = trainer.restore(setup.selection.checkpoint if setup.selection is not None else None)
        if step >= setup.steps:
            say_once(ctx, f"the checkpoint is at step {step} = --steps: nothing to train")
    log_dir = job.held_out.log_dir
    if log_dir is not None and ctx.rank == 0:
        from ..evaluation.log import MetricsLog

        trainer.log = MetricsLog(log_dir, trainer.run_id, start_step=trainer.step)
        if trainer.log.moved_aside is not None:
            say_once(ctx, f"{log_dir}: the earlier metrics.jsonl is now {trainer.log.moved_aside.name}")
    return trainer


def run_job(job: TrainPlan, ctx: Comm, monitor: JobMonitor | None = None) -> TrainSummary | None:
    """Set up and train (collective); the summary on rank 0. SetupFailed (every rank, one message) when set-up
    is refused; NonFiniteError or CheckpointWriteError (every rank) when the run stops."""
    return started_trainer(job, ctx, monitor).run()


def train(**keywords: object) -> TrainSummary | None:
    """``dl.train``: run ``train`` from Python on every rank of the job (collective): the keyword arguments name its
    flags (``model="resnet", num_layers=8, val_fraction=0.25, checkpoint_dir="ckpt"``); returns the TrainSummary on
    rank 0 (None elsewhere). ConfigError for a setting refused before any rank talks, SetupFailed (every rank, one
    message) for a set-up refused on some rank."""
    from ..comm.context import init

    plan = TrainJob.of(**keywords).check()
    ctx = init(backend=plan.options.backend, device=plan.options.device)
    plan.config.validate(world_size=ctx.world_size)
    return run_job(plan, ctx)
