"""What slide inference needs of a trained network: its fully convolutional form, whether it classifies patches or
segments pixels, its class names and the resolution it trained at; refusals for what cannot stream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.record import WRITTEN_BY, RunRecord
from ..config import ConfigError
from ..data.stain import StainNormalizer
from ..data.task import Task
from ..models.spec import ModelFamily
from .fully_conv import FullyConvolutional, classifies, fully_convolutional, spatial_dims
from .model import ModelDescription, ModelObject, load_trained
from .probes import input_channels
from .tile_map import cell_grid, lone_tile_classes
from .whole_volume import whole_input_layer, whole_volume_network


def network_task(layers: Sequence[nn.Module], patch: int | None = None) -> Task:
    """What a network's output cells are: a classifier (a ``ClassifierHead`` or a pooled head last,
    ``fully_conv.classifies``, or, given its training side ``patch``, one vector per image: a transformer,
    ``tile_map.lone_tile_classes``) gives each cell the probabilities of the patch under it; anything else is dense
    (per-pixel probabilities): segmentation."""
    whole = classifies(layers) or lone_tile_classes(layers, patch) is not None
    return Task.CLASSIFICATION if whole else Task.SEGMENTATION


@dataclass(frozen=True)
class TrainedNetwork:
    """A trained network ready to stream: the FCN, its task, class names (output order), training MPP and the stain
    normaliser its images were read through (None: none)."""

    net: FullyConvolutional
    description: ModelDescription
    task: Task
    classes: tuple[str, ...]
    mpp: float | None
    layers: tuple[nn.Module, ...] = ()     # the layers as trained (``--map-mode tiles`` runs them on lone tiles)
    stain: StainNormalizer | None = None
    lone_tiles: bool = False               # no FCN (a transformer): ``net`` is the cell grid, tiles mode only

    @property
    def cell_extent(self) -> int:
        """Input pixels one output cell describes per axis: the training patch (classifier) or its own stride."""
        return self.description.image_size if self.task is Task.CLASSIFICATION else self.net.shape.stride

    def check_task(self, expected: Task | str | None) -> None:
        """Refuse a checkpoint of the other task (``--task``), before any work."""
        if expected is None or Task.parse(expected) is self.task:
            return
        other = {Task.CLASSIFICATION: "a classifier (its last layer pools the image into one prediction)",
                 Task.SEGMENTATION: "a dense network (one prediction per pixel)"}[self.task]
        raise ConfigError("--task", f"{self.description.path} holds {other}, not a {expected} network; pass a "
                                    f"{expected} checkpoint, or drop --task {expected} to run it as what it is")


WHOLE_IMAGE_NORMS = (nn.GroupNorm, nn.LayerNorm)


def check_streamable(layers: Sequence[nn.Module]) -> None:
    """Refuse layers whose output at a pixel depends on the whole image (a window cannot equal the whole slide)."""
    for name, module in nn.Sequential(*layers).named_modules():
        instance = isinstance(module, nn.modules.instancenorm._InstanceNorm) and not module.track_running_stats
        if isinstance(module, WHOLE_IMAGE_NORMS) or instance:
            raise ConfigError("--checkpoint", f"layer {name} ({type(module).__name__}) normalises over the whole "
                                              f"image, so no window can compute what the network gives on the whole "
                                              f"slide; slide inference needs normalisation per pixel (BatchNorm, "
                                              f"which runs on its running statistics, or none): train with BatchNorm")


def refuse_volume_classifier(record: RunRecord, file: Path) -> None:
    """``infer --volume`` writes a class per voxel: refuse a checkpoint of a classifier (one class per image), naming
    its model, what volume inference needs and where a classifier's figures come from."""
    if record.task is not Task.CLASSIFICATION:
        return
    raise ConfigError("--checkpoint", f"{file} holds {record.model.describe()}, a classifier (one class per image); "
                                      f"infer --volume writes a class per voxel and needs a dense segmentation "
                                      f"network (e.g. train --task segmentation --model unet3d). A volume "
                                      f"classifier's figures on held-out volumes come from train --val-fraction or "
                                      f"--folds (its summary and metrics.jsonl); evaluate takes image models only")


def load_network(checkpoint: str, *, family: ModelFamily | str | None = None, dtype: torch.dtype = torch.float32,
                 output_stride: int | None = None, task: Task | str | None = None,
                 check: bool = True, model: ModelObject | None = None) -> TrainedNetwork:
    """The checkpoint's network as inference runs it; ConfigError/ValueError naming the flag for what does not fit.
    ``model``: the model object of a run built in Python (``model.load_trained``)."""
    layers, description, record = load_trained(checkpoint, family, dtype, check=check, model=model)
    kind = network_task(layers, description.image_size)
    if kind is not record.task:
        raise ValueError(f"--checkpoint {description.path}: its record says {record.task} but its network is a "
                         f"{kind} network; {WRITTEN_BY}")
    trained = inference_network(layers, description, record.class_names, record.data.mpp,
                                output_stride=output_stride, task=task)
    return replace(trained, stain=record.stain)


def class_names(classes: Sequence[str], count: int) -> tuple[str, ...]:
    """The record's class names when they are ``count``, else the indices ``0 .. count-1`` as names."""
    return tuple(classes) if len(classes) == count else tuple(str(c) for c in range(count))


def inference_network(layers: Sequence[nn.Module], description: ModelDescription, classes: Sequence[str],
                      mpp: float | None, *, output_stride: int | None = None,
                      task: Task | str | None = None) -> TrainedNetwork:
    """A trained layer list (eval mode) as inference runs it: checked, made fully convolutional (a network that needs
    the whole volume, ``whole_volume.WholeInput``: as one window, unprobed; a classifier of lone tiles only, a
    transformer: its cell grid, ``tile_map.cell_grid``)."""
    count = lone_tile_classes(layers, description.image_size)
    if count is not None:
        trained = TrainedNetwork(cell_grid(description.image_size, output_stride, count), description,
                                 Task.CLASSIFICATION, class_names(classes, count), mpp, tuple(layers), lone_tiles=True)
        trained.check_task(task)
        return trained
    kind = network_task(layers)
    if whole_input_layer(layers) is not None:
        if output_stride is not None:
            raise ConfigError("--output-stride", "applies to classifiers only; a dense model's stride is its own")
        net = whole_volume_network(layers)
    else:
        check_streamable(layers)
        channels = input_channels(nn.Sequential(*layers)) if spatial_dims(layers) == 3 else 3   # a volume's own
        net = fully_convolutional(layers, description.image_size, channels=channels, output_stride=output_stride)
    trained = TrainedNetwork(net, description, kind, class_names(classes, net.shape.classes), mpp, tuple(layers))
    trained.check_task(task)
    return trained

