"""An EvaluatePlan turned into its run (``evaluate`` and ``dl.evaluate`` of keywords): the checkpoint's network
(refused if another than the flags name), the data and held-out images resolved against its record, set up in
stages every rank agrees on, then evaluated with the run's loss on any layout."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..checkpoint.record import RunRecord, SplitRecord
from ..comm.agreement import agreed
from ..config import ConfigError
from ..console import SetupLines
from ..data.apps import AppKind
from ..data.classes import folder_classes, label_order
from ..data.groups import BY_SLIDE, GroupKind
from ..data.tissue_mask import TissueMethod
from ..evaluation.evaluator import Evaluator
from ..evaluation.levels import sample_groups
from ..evaluation.metrics import Metrics
from ..evaluation.pixel_metrics import SegmentationMetrics
from ..evaluation.slide_table import write_slide_csv
from ..infer.recorded_stain import COMMAND_KNOBS, StainChoice, refusing_broken_stain
from .evaluate_job import EvaluatePlan
from .evaluation_summary import EvaluationSummary
from .held_out_spec import HeldOutSpec
from .job import DataSpec, data_text

if TYPE_CHECKING:
    from torch import nn

    from ..comm.protocol import Comm
    from ..data.dataset import RegionDataset
    from ..data.manifest import Cohort
    from ..infer.model import ModelDescription


def resolved_data(plan: EvaluatePlan, record: RunRecord) -> DataSpec:
    """The data to read: the flags given, the checkpoint's settings for the rest (its training resolution unless
    ``--slide-level`` or ``--mpp``/``--magnification``)."""
    job, data = plan.job, record.data
    cohort = cohort_to_read(plan, record)
    app = AppKind.MEDICAL if cohort is not None else job.app or data.app
    target = job.resolution.target
    mpp = None if job.slide_level is not None else (data.mpp if target is None else target)
    # no data flags: the data the checkpoint records (its folder or cohort), not the bundled sample
    datapath = job.datapath if job.app is not None or job.datapath is not None or cohort else data.datapath
    # the training run's class names order the labels of class folders (masks carry their labels as values)
    order = None if record.task.dense else label_order(folder_classes(app, datapath), data.classes)
    stain = StainChoice(record.stain, job.stain_normalize)
    if stain.applied is not None and app is not AppKind.MEDICAL:
        raise stain.refuse_unstained(f"--app {app}", COMMAND_KNOBS)
    size = job.image_size if isinstance(job.image_size, int) else None
    if data.whole_slide and job.tissue is not TissueMethod.SATURATION:
        raise ConfigError("--tissue", "picks the tiles cut from slides; this checkpoint's whole-slide canvases "
                                      "place each slide's tissue by the saturation mask: drop --tissue")
    return DataSpec(app=app, datapath=datapath, image_size=size or data.image_size,
                    num_samples=job.num_samples, slide_level=job.slide_level or 0, min_tissue=job.min_tissue,
                    tissue=job.tissue, repair_annotations=job.repair_annotations, mpp=mpp,
                    source_mpp=job.resolution.source_mpp, num_classes=record.model.num_classes,
                    class_names=record.class_names, class_order=order, task=record.task,
                    ignore_index=record.segmentation.ignore_index if record.segmentation is not None else None,
                    cohort=cohort, whole_slide=data.whole_slide,
                    tissue_channel=data.whole_slide and record.model.pool.tissue,
                    stain=stain.applied)     # images read as the run read them (unless --no-stain-normalize)


def cohort_to_read(plan: EvaluatePlan, record: RunRecord) -> Cohort | None:
    """The cohort to evaluate: ``--cohort``'s, else (no data flags) the one the checkpoint records; its labels
    taken in the checkpoint's class order (ConfigError listing every line with another label)."""
    from ..data.manifest import read_cohort

    job = plan.job
    if plan.cohort is not None:
        return read_cohort(plan.cohort.source, record.class_names, probe=None)
    if job.app is None and job.datapath is None and record.data.cohort is not None:
        return read_cohort(record.data.cohort, record.class_names)
    return None


def other_cohort(plan: EvaluatePlan, record: RunRecord) -> bool:
    """Whether ``--cohort`` names another manifest than the one the checkpoint was trained on."""
    return plan.cohort is not None and str(plan.cohort.source) != record.data.cohort


def resolved_held_out(plan: EvaluatePlan, record: RunRecord) -> HeldOutSpec:
    """The images to evaluate: the flags' held-out images, every image (``--all-data``), else the run's split
    (grouped as the run grouped it, unless ``--group-by`` says otherwise)."""
    job = plan.job
    if job.all_data or other_cohort(plan, record):      # another cohort: every slide of it
        return HeldOutSpec(group_by=job.held_out.group_by)
    if job.held_out.given:
        return job.held_out
    split = record.split
    if split is None:
        return HeldOutSpec(record.data.val_fraction, record.data.val_datapath, group_by=job.held_out.group_by)
    return HeldOutSpec(record.data.val_fraction, record.data.val_datapath,
                       group_by=job.held_out.group_by or recorded_grouping(split), folds=split.folds, fold=split.fold)


def recorded_grouping(split: SplitRecord) -> str | None:
    """The ``--group-by`` that groups the data as ``split`` was: its regex, or ``slide`` for a split by slide (a
    checkpoint from before slides named by TCGA barcodes were grouped by patient keeps its slides)."""
    if split.group_by is None and split.grouping == GroupKind.SLIDE.value:
        return BY_SLIDE
    return split.group_by


def fixed_image_size(layers: Sequence[nn.Module]) -> tuple[int, int] | None:
    """The (rows, cols) a loaded model takes and no other (a ViT's position embeddings, a Swin's windows; None:
    any size)."""
    from ..models.pieces import SizedPiece
    from ..models.vit import TokenEmbedding, token_image_size

    for layer in layers:
        if isinstance(layer, SizedPiece):
            return layer.built
        if isinstance(layer, TokenEmbedding):
            return None if layer.settings.get("dynamic_img_size") else token_image_size(layer)
    return None


def check_trained_image_size(layers: Sequence[nn.Module], image_size: int) -> None:
    """ConfigError(``--image-size``) before work when the checkpoint's model takes one image size only and
    ``image_size`` is another, naming the size it was trained at."""
    built = fixed_image_size(layers)
    if built is None or built == (image_size, image_size):
        return
    size = str(built[0]) if built[0] == built[1] else f"{built[0]}x{built[1]}"
    fix = f"give --image-size {size} or leave it out" if built[0] == built[1] else "leave --image-size out"
    raise ConfigError("--image-size", f"{image_size}: the checkpoint's model was trained on {built[0]}x{built[1]} "
                                      f"images and takes that size only; {fix}")


class Evaluation:
    """Set-up of an evaluation in agreed stages (every rank the same verdict), then the run."""

    def __init__(self, plan: EvaluatePlan, ctx: Comm) -> None:
        self.plan, self.job, self.ctx = plan, plan.job, ctx
        self.layers: list[nn.Module] = []
        self.record: RunRecord | None = None
        self.description: ModelDescription | None = None
        self.data = DataSpec()
        self.held_out = HeldOutSpec()
        self.batch_size = 0
        self.dtype = "float32"
        self.dataset: RegionDataset | None = None
        self.split = "all"
        self.stain = StainChoice(None)

    @property
    def seed(self) -> int:
        assert self.record is not None, "load() read the record"
        return self.job.seed if self.job.seed is not None else self.record.seed

    def read(self) -> None:
        """The checkpoint's record (its model refused if another than the flags name), the data settings resolved
        against it: no model built, no weight read, so the data is checked before the checkpoint is loaded."""
        from ..checkpoint.record import read_checkpoint
        from ..infer.model import ModelDescription, check_family, find_checkpoint

        job, path = self.job, self.plan.checkpoint

        def record() -> tuple[ModelDescription, RunRecord]:
            file = find_checkpoint(path)       # rank 0 checksums the file: a damaged one stops every rank here
            checkpoint = read_checkpoint(file, lazy=True, check=self.ctx.rank == 0)
            if job.model.model is not None:
                check_family(job.model.model, checkpoint.record.model, file)
            return ModelDescription.of(checkpoint), checkpoint.record

        self.description, self.record = refusing_broken_stain(path, record, COMMAND_KNOBS)
        self.stain = StainChoice(self.record.stain, job.stain_normalize)
        self.check_record(self.record, f"--checkpoint {self.description.path}")
        self.data, self.held_out = resolved_data(self.plan, self.record), resolved_held_out(self.plan, self.record)
        self.dtype = job.dtype or self.record.data.dtype
        batch = job.batch_size or self.record.data.batch_size
        self.batch_size = -(-batch // job.config.batch_divisor) * job.config.batch_divisor

    def load(self) -> None:
        """The checkpoint's network, checked against the image size and the layout (its file checked by ``read``)."""
        import torch

        from ..infer.model import load_trained
        from .trainer import check_layout

        assert self.description is not None, "read() found the checkpoint"
        job, file = self.job, self.description.path
        dtype = getattr(torch, job.dtype) if job.dtype else None
        # without --dtype the layers come in float64 (which holds either dtype exactly) and go to the checkpoint's
        self.layers, _, _ = load_trained(file, job.model.model, dtype or torch.float64, check=False)
        if dtype is None:
            for layer in self.layers:
                layer.to(getattr(torch, self.dtype))
        check_trained_image_size(self.layers, self.data.image_size)
        check_layout(job.config, self.layers, self.batch_size, self.data.image_size)
        from ..models.vit import refuse_token_spatial_stage  # what a cut ViT cannot run on tiles, before work

        refuse_token_spatial_stage(self.layers, job.config, self.data.image_size)

    def check_record(self, record: RunRecord, where: str) -> None:
        """ConfigError when the checkpoint holds another model or task than the flags name, or a model of volumes."""
        from .identity import task_mismatch

        self.job.model.check(record, where)
        problem = task_mismatch(record.task, self.job.task, where) if self.job.task is not None else None
        if problem is not None:
            raise ConfigError("--task", problem)
        if record.model.family.volumetric:
            raise ConfigError("--checkpoint", f"{where.removeprefix('--checkpoint ')} holds a model of volumes "
                              f"({record.model.family.value}): evaluate takes image models only. A volume run's "
                              f"held-out figures (Dice per volume) are in its own summary and metrics.jsonl (train "
                              f"--val-fraction or --folds); infer --volume runs the model over a volume")

    def open_data(self) -> None:
        """The images to evaluate: the training run's held-out split (checked to be the same), or all."""
        from .job_data import dataset_from, held_out_data

        data, job = self.data, self.job
        dataset = dataset_from(data, self.seed, data.datapath)
        if dataset.num_classes > data.num_classes:
            raise ConfigError("--datapath", f"the data has {dataset.num_classes} classes, the checkpoint's "
                              f"model {data.num_classes}: a checkpoint of another model, or other data")
        _, held, self.split, _ = held_out_data(data, self.held_out, self.seed, dataset)
        assert self.record is not None, "load() read the record"
        saved = self.record.identity.get("val_split")
        explicit = job.held_out.given or job.all_data or other_cohort(self.plan, self.record)
        if held is not None and saved not in (None, "none") and saved != self.split and not explicit:
            raise ConfigError("--datapath", f"the held-out images differ from the training run's "
                              f"({self.split!r}, trained with {saved!r}): give the same --app/--datapath/--num-samples/"
                              f"--image-size as the training run, or --val-fraction/--val-datapath/--all-data "
                              f"to evaluate other images on purpose")
        self.dataset = held if held is not None else dataset
        # the images' slides here, in an agreed stage: a tile folder's slide in two class folders is refused before work
        groups = None if data.task.dense else sample_groups(self.dataset, self.held_out.group_by)
        if job.slide_csv is not None and groups is None:
            raise ConfigError("--slide-csv", "tabulates slides, and these images come from none known; evaluate "
                                             "a --cohort, slides, or tiles named <slide>_<x>_<y> (--group-by)")

    def run(self) -> EvaluationSummary | None:
        """Evaluate (collective) with the run's loss; the summary on rank 0."""
        import time

        import torch

        from ..pipeline.engine import HybridEngine
        from .held_out import evaluator_for

        assert self.description is not None and self.dataset is not None, "load() and open_data() ran"
        assert self.record is not None, "load() read the record"
        job, dtype = self.job, getattr(torch, self.dtype)
        engine = HybridEngine(self.layers, job.config, self.ctx, image_size=self.data.image_size,
                              loss_fn=self.record.loss())
        start = time.perf_counter()
        evaluator = evaluator_for(engine, self.dataset, self.ctx, self.batch_size, self.record, dtype,
                                  self.held_out.group_by, job.aggregate)
        evaluator.show_progress(job.progress and self.ctx.rank == 0)
        if isinstance(evaluator, Evaluator) and evaluator.groups is not None:
            records = evaluator.records()          # rank 0: every tile's record, merged exactly
            if records is None:
                return None
            metrics: Metrics | SegmentationMetrics = evaluator.summary(records)
            if job.slide_csv is not None:
                write_slide_csv(job.slide_csv, evaluator.groups.slide_predictions(records, job.aggregate),
                                self.record.class_names)
        else:
            metrics = evaluator.run()
        if self.ctx.rank != 0:
            return None
        best = self.record.best if job.source.checkpoint_select == "best" else None
        return EvaluationSummary(self.description.path, self.description.step, self.description.describe(),
                                 self.split, str(self.data.app), self.data.image_size, self.batch_size, self.dtype,
                                 self.ctx.world_size, metrics, time.perf_counter() - start, job.config.as_dict(),
                                 str(job.source.checkpoint_select), best, self.record.loss().describe(),
                                 job.aggregate.describe(), self.stain.describe())


def run_evaluation(plan: EvaluatePlan, ctx: Comm) -> EvaluationSummary | None:
    """Set up in agreed stages (SetupFailed on every rank, one message, when refused), say once which stain
    normaliser the images are read through, evaluate (collective); the summary on rank 0. A set-up line as each part
    starts (rank 0, unless ``--no-progress``)."""
    evaluation = Evaluation(plan, ctx)
    setup = SetupLines("evaluate", plan.job.progress and ctx.rank == 0)
    setup.doing(f"reading the checkpoint's record {plan.checkpoint}")
    agreed(ctx, evaluation.read)
    setup.doing(data_text(evaluation.data))
    agreed(ctx, evaluation.open_data)             # the data before the model: a bad folder refused at once
    setup.doing(f"loading the checkpoint's model {evaluation.description.path if evaluation.description else ''}")
    agreed(ctx, evaluation.load)
    header = evaluation.stain.header(COMMAND_KNOBS)
    if header is not None and ctx.rank == 0:
        print(f"mpi4dl_nb evaluate: {header}", file=sys.stderr, flush=True)
    setup.doing(f"placing the model on {ctx.world_size} rank{'s' * (ctx.world_size > 1)}")
    return evaluation.run()
