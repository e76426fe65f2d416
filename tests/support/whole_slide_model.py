"""Whole-slide checkpoints for slide-level inference tests: a hand-set structure detector (its attention or max head
responds to the dark structures of data/synthetic_cohort.py) and a random network with BatchNorm statistics."""

from __future__ import annotations

from pathlib import Path

import torch

from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord, write_checkpoint
from mpi4dl_nb.data.apps import AppKind
from mpi4dl_nb.data.synthetic_cohort import CLASSES
from mpi4dl_nb.data.task import Task
from mpi4dl_nb.models.slide_encoder import SlideEncoderSpec
from mpi4dl_nb.models.spec import ModelSpec
from tests.support.infer_data import neutral_batchnorms

DARK = 0.7       # darkness (1 - mean RGB) above which a cell is a structure: structures 0.80, nuclei 0.56, stroma 0.24


def spec_of(pool: str, encoder: SlideEncoderSpec | None = None) -> ModelSpec:
    return ModelSpec.of("resnet", num_layers=8, num_filters=4, num_classes=2, resnet_version=1, pool=pool,
                        slide_encoder=encoder)


def write_whole_slide(directory: Path, layers: list[torch.nn.Module], spec: ModelSpec, image_size: int,
                      mpp: float | None) -> Path:
    """A checkpoint of ``layers`` as ``train --whole-slide`` writes it (record with ``whole_slide``, weights)."""
    record = RunRecord(spec, DataRecord(AppKind.MEDICAL, image_size, 1, "float64", classes=CLASSES, mpp=mpp,
                                        whole_slide=True), task=Task.CLASSIFICATION)
    write_checkpoint(directory, record.at(1, "a0b1c2d3e4f5"), torch.nn.Sequential(*layers).state_dict(), None)
    return directory


def structure_detector(directory: Path, pool: str = "attention", image_size: int = 256,
                       mpp: float | None = 0.5) -> Path:
    """A ResNet v1 (8 layers, width 4, trunk stride 4) set by hand, not trained: every trunk channel is the darkness
    ``1 - mean(RGB)`` of one pixel per cell (the stem's centre tap, BatchNorm bias 1; every block passes its
    shortcut only); the attention head scores ``10 tanh(20 (darkness - DARK))`` (structures about +10, everything
    else about -10), the max head takes the darkest cell; the classifier says ``positive`` when the pooled darkness
    exceeds what stroma and nuclei reach."""
    spec = spec_of(pool)
    torch.manual_seed(0)
    layers = [layer.double() for layer in spec.build(image_size)]
    with torch.no_grad():
        neutral_batchnorms(layers)
        stem = layers[0]
        stem.conv.weight.zero_()
        stem.conv.weight[:, :, 1, 1] = -1.0 / 3.0
        stem.bn.bias.fill_(1.0)                     # darkness = 1 - brightness, >= 0
        for block in layers[1:-1]:
            block.bn2.weight.zero_()
            if not isinstance(block.shortcut, torch.nn.Identity):
                conv = block.shortcut[0]
                conv.weight.zero_()
                for c in range(conv.out_channels):
                    conv.weight[c, c % conv.in_channels, 0, 0] = 1.0
        head = layers[-1]
        if pool == "attention":
            attention = head.pool
            for layer in (attention.V, attention.U, attention.w):
                layer.weight.zero_()
            attention.V.weight[0, 0] = 20.0
            attention.V.bias.fill_(-20.0 * DARK)
            attention.U.bias.fill_(10.0)            # the gate open everywhere
            attention.w.weight[0, 0] = 10.0
        head.fc.weight.zero_()
        head.fc.bias.zero_()
        head.fc.weight[1, 0] = 40.0
        head.fc.bias[1] = -40.0 * (0.5 if pool == "attention" else 0.68)
    return write_whole_slide(directory, layers, spec, image_size, mpp)


def random_whole_slide(directory: Path, pool: str, image_size: int, mpp: float | None, seed: int = 0,
                       encoder: SlideEncoderSpec | None = None) -> Path:
    """A ResNet v1 (8 layers, width 4; ``encoder``: with a slide encoder) of random weights and BatchNorm running
    statistics, float64."""
    spec = spec_of(pool, encoder)
    torch.manual_seed(seed)
    layers = [layer.double() for layer in spec.build(image_size)]
    with torch.no_grad():
        for module in torch.nn.Sequential(*layers).modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
    return write_whole_slide(directory, layers, spec, image_size, mpp)
