"""``train``'s flags checked against each other before anything is read (the task against the model, volumes,
held-out data, ``--keep-best``): ConfigError naming the flag and the way out. Each group's own checks run as it is
built (``run/model_choice.py``, ``run/data_choice.py``, ...); these need two groups."""
from __future__ import annotations

from typing import Protocol

from ..config import ParallelConfig
from ..data.apps import AppKind
from ..data.task import Task
from ..data.volume.groups import PATIENTS_FILE
from ..errors import ConfigError
from ..evaluation.metrics import MetricName
from ..loss import LossKind
from ..models.spec import ModelFamily, split_model
from .data_choice import DataChoice
from .held_out_spec import ValidationSpec
from .model_choice import ModelChoice
from .run_options import CheckpointSpec
from .training_spec import TrainingSpec

CLASSIFIERS = (ModelFamily.RESNET, ModelFamily.AMOEBANET)
PER_TASK_METRICS = {Task.CLASSIFICATION: (MetricName.VAL_BALANCED_ACCURACY, MetricName.VAL_ROC_AUC),
                    Task.SEGMENTATION: (MetricName.VAL_MEAN_DICE, MetricName.VAL_MEAN_IOU)}


class TrainFlags(Protocol):
    """What the checks read of a ``train`` job: its flag groups."""

    @property
    def config(self) -> ParallelConfig: ...
    @property
    def model(self) -> ModelChoice: ...
    @property
    def data(self) -> DataChoice: ...
    @property
    def training(self) -> TrainingSpec: ...
    @property
    def held_out(self) -> ValidationSpec: ...
    @property
    def checkpoints(self) -> CheckpointSpec: ...


def check_train_flags(job: TrainFlags) -> None:
    """Every check of ``train`` that needs two flag groups, in the order the command has always said them."""
    check_task_flags(job)
    check_volume_flags(job)
    data = job.data
    if job.held_out.val_datapath is not None and not data.reads.reads_datapath:
        raise ConfigError("--val-datapath", f"--app {data.reads} reads no files; use --val-fraction")
    check_keep_best(job)
    check_layer_decay(job)
    if job.training.balanced_sampler and job.data.task.dense:
        raise ConfigError("--balanced-sampler", f"draws each class's images equally; --task {job.data.task} labels "
                                                f"pixels, not images: weigh classes with --class-weights balanced")


def check_layer_decay(job: TrainFlags) -> None:
    """``--layer-decay`` against the model: it decays a ViT's rates block by block, and this project's families and
    a timm model other than a ViT or Eva (found on the meta device: no weights) have no such blocks; a torchvision
    model or a callable's is checked once built (``models/vit.layer_decay_scales``)."""
    if job.training.optimizer.layer_decay is None:
        return
    model = job.model.model
    family, source = split_model(model)
    found = f"--model {model} has none"
    if family is ModelFamily.TIMM and source is not None:
        from ..models.external import timm_probe
        from ..models.vit import is_token_model

        probe = timm_probe(source)
        if is_token_model(probe):
            return
        found = f"--model {model} is a {type(probe).__name__}"
    elif family.named:
        return
    raise ConfigError("--layer-decay", f"decays a vision transformer's rates block by block (timm's ViT and Eva); "
                                       f"{found} (a ViT: --model timm:vit_small_patch16_224): drop --layer-decay")


def check_task_flags(job: TrainFlags) -> None:
    """The task against the model and the segmentation flags (``--app medical`` implied by ``--datapath``)."""
    data, model, family = job.data, job.model, job.model.family
    if not data.task.dense:
        if family.dense:
            raise ConfigError("--task", f"--model {family} predicts a class per pixel; add --task segmentation "
                                        f"(with masks or annotations as --datapath)")
        for flag, given in (("--loss", job.training.loss is not LossKind.CE), ("--ignore-index", data.ignore_index
                            is not None), ("--norm", model.norm is not None), ("--upsampling",
                                                                               model.upsampling is not None)):
            if given:
                raise ConfigError(flag, "applies to --task segmentation only")
        return
    if family in CLASSIFIERS or (family.volumetric and not family.dense):
        raise ConfigError("--model", f"{family} is a classifier (one class per image); --task segmentation trains "
                                     f"a dense model: use --model {'unet3d' if family.volumetric else 'unet'}")
    for flag, value in (("--norm", model.norm), ("--upsampling", model.upsampling)):
        if value is not None and not family.dense:
            raise ConfigError(flag, "sets a U-Net's layers; it applies to --model unet only")
    if data.app is AppKind.CIFAR:
        raise ConfigError("--app", "CIFAR-10 has no per-pixel labels; segmentation reads --datapath (images/ and "
                                   "masks/, or slides with QuPath GeoJSON) or --app medical (the IHC sample)")
    if data.datapath is None and data.app is AppKind.SYNTHETIC:
        raise ConfigError("--task", "segmentation needs per-pixel labels: --datapath D (D/images/ with D/masks/, "
                                    "or slides with their QuPath GeoJSON beside them), or --app medical for the IHC "
                                    "sample with its DAB-positive stand-in mask")


def check_volume_flags(job: TrainFlags) -> None:
    """The volume flags against the model and task (the folder they read: the job's check)."""
    data, family = job.data, job.model.family
    if not data.volume:
        if family.volumetric:
            raise ConfigError("--image-size", f"--model {family} trains on volumes: give --image-size D,H,W (the "
                                              f"patch's depth, height and width in voxels)")
        if data.voxel_size is not None:
            raise ConfigError("--voxel-size", "applies to volumes (--image-size D,H,W); images use --mpp")
        return
    if not family.volumetric:
        shown = ",".join(map(str, data.image_size)) if isinstance(data.image_size, tuple) else data.image_size
        raise ConfigError("--image-size", f"{shown} is a volume's patch but --model {job.model.model} takes images: "
                                          f"use --model unet3d (segmentation) or resnet3d (classification), or one "
                                          f"image side")
    if family.dense and not data.task.dense:
        raise ConfigError("--task", f"--model {family} segments volumes (a class per voxel): add --task "
                                    f"segmentation, or classify whole volumes with --model resnet3d")
    if not family.dense and data.task.dense:
        raise ConfigError("--task", f"--model {family} classifies whole volumes: use --task classification, or "
                                    f"segment them with --model unet3d")
    check_volume_layout(job)
    for flag, given in (("--augment", bool(job.training.augment)), ("--mpp", data.resolution.target is not None),
                        ("--whole-slide", data.whole_slide), ("--val-datapath", job.held_out.val_datapath)):
        if given:
            raise ConfigError(flag, "does not apply to volumes yet; drop it" if flag != "--mpp" else
                              "sets images' µm per pixel; volumes take --voxel-size Z,Y,X")
    if job.held_out.group_by is not None:
        raise ConfigError("--group-by", f"groups tile files by name; a split of volumes holds out whole volumes, "
                                        f"grouped by patient when --datapath has a {PATIENTS_FILE} (columns "
                                        f"volume,patient): drop --group-by")


def check_volume_layout(job: TrainFlags) -> None:
    """A volume classifier keeps a layer stage after the spatial ones; volumes are not CIFAR-10."""
    cfg, family = job.config, job.model.family
    if not family.dense and cfg.spatial_size > 0 and cfg.spatial_size >= cfg.split_size:
        raise ConfigError("--spatial-size", f"--model {family} gives one class per volume, and its head joined on "
                                            f"volume tiles is not checked against one process yet (images' is): "
                                            f"keep a layer stage after the spatial ones (e.g. "
                                            f"--split-size {cfg.spatial_size + 1} --spatial-size {cfg.spatial_size})")
    if job.data.app is AppKind.CIFAR:
        raise ConfigError("--app", "CIFAR-10 holds images, not volumes: drop --app (volumes are read from --datapath)")


def check_keep_best(job: TrainFlags) -> None:
    """``--keep-best`` measures checkpoints on held-out data, by a figure of the run's task."""
    best, task = job.checkpoints.keep_best, job.data.task
    if best is None:
        return
    if not job.held_out.given:
        raise ConfigError("--keep-best", "measures checkpoints on validation data: add --val-fraction F or "
                                         "--val-datapath DIR")
    other = [m for t, metrics in PER_TASK_METRICS.items() if t is not task for m in metrics]
    if best in other:
        mine = ", ".join(m.value for m in (MetricName.VAL_LOSS, MetricName.VAL_ACCURACY, *PER_TASK_METRICS[task]))
        raise ConfigError("--keep-best", f"{best} is not a figure of --task {task}; use one of {mine}")
