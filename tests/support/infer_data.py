"""Inference test data: a checkpoint written by the real ``train`` command, pyramidal test slides, the
whole-slide reference (the fully convolutional network on the whole zero-extended level, one process)."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import numpy as np
import torch

from mpi4dl_nb.data.slide_writer import write_slide  # noqa: F401  (re-exported to the tests)

from .pyramid import write_pyramid

TRAIN_FLAGS = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
               "--image-size", "32", "--batch-size", "2", "--split-size", "1", "--spatial-size", "0",
               "--app", "medical", "--num-classes", "2", "--steps", "2", "--no-progress", "--dtype", "float64"]


def make_checkpoint(directory: Path, *extra: str) -> Path:
    """Train a small ResNet v1 two steps on the bundled tissue sample (one process) and checkpoint it."""
    from mpi4dl_nb.cli.train_cmd import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*TRAIN_FLAGS, *extra, "--checkpoint-dir", str(directory)]) == 0
    return directory


def make_checkpoint_alone(directory: Path) -> Path:
    """``make_checkpoint`` on one rank of a launch: the command's set-up and training on a communicator of its own
    (as ``train`` would run it in one process, without its check of the launched world)."""
    from mpi4py import MPI

    from mpi4dl_nb.cli.train_cmd import train_parser, train_plan
    from mpi4dl_nb.comm.context import Context
    from mpi4dl_nb.run.job_run import build_trainer, set_up_run

    plan = train_plan(train_parser().parse_args([*TRAIN_FLAGS, "--checkpoint-dir", str(directory)]))
    with contextlib.redirect_stdout(io.StringIO()):
        summary = build_trainer(set_up_run(plan, Context(comm=MPI.COMM_SELF)), None).run()
    assert summary is not None and summary.checkpoint is not None
    return directory


def tissue_image(height: int, width: int) -> np.ndarray:
    """The IHC sample tiled (mirrored) to ``height x width`` RGB, with bare glass on the right third."""
    from skimage import data

    sample = data.immunohistochemistry()
    tiles = np.concatenate([sample, sample[:, ::-1]], axis=1)
    tiles = np.concatenate([tiles, tiles[::-1]], axis=0)
    reps = (-(-height // tiles.shape[0]), -(-width // tiles.shape[1]), 1)
    image = np.tile(tiles, reps)[:height, :width].copy()
    image[:, width - width // 3:] = 245   # glass: no tissue
    return image


def make_slide(path: Path, height: int, width: int, levels: int = 3) -> Path:
    write_pyramid(path, tissue_image(height, width), levels=levels, tile=64)
    return path


def whole_slide_reference(checkpoint: Path, slide: Path, level: int = 0, *, stain: bool = False) -> np.ndarray:
    """The fully convolutional network on the whole (zero-extended) slide level in one process, float64 (``stain``:
    the pixels normalised by the checkpoint's stain normaliser, from the slide's overview)."""
    from mpi4dl_nb.infer.fully_conv import fully_convolutional
    from mpi4dl_nb.infer.model import load_layers
    from mpi4dl_nb.infer.reader import SlideReader
    from mpi4dl_nb.infer.windows import padded_extent

    layers, description = load_layers(checkpoint, dtype=torch.float64)
    net = fully_convolutional(layers, description.image_size)
    reader = SlideReader(slide, level)
    unit = math.lcm(net.shape.stride, net.shape.align)
    height, width = padded_extent(reader.height, unit), padded_extent(reader.width, unit)
    x = torch.from_numpy(reader.read((0, height, 0, width))).permute(2, 0, 1).double().div(255.0)
    if stain:
        from mpi4dl_nb.checkpoint.record import read_checkpoint
        from mpi4dl_nb.data.pathology import slide_overview
        from mpi4dl_nb.data.stain_reads import stain_normalized
        from mpi4dl_nb.infer.model import find_checkpoint

        normalizer = read_checkpoint(find_checkpoint(checkpoint)).record.stain
        assert normalizer is not None, f"{checkpoint} records no stain normaliser"
        x = stain_normalized(x, normalizer.map_for(slide_overview(reader.slide)))
    with torch.no_grad():
        return net(x[None])[0].numpy()


def relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-12))


# --------------------------------------------------------------------- hand-made checkpoints
def write_network(directory: Path, layers, spec, image_size: int, classes, mpp: float | None = None,
                  dtype: str = "float64") -> Path:
    """A checkpoint of ``layers`` (built from ``spec``) as ``train`` writes them: record, weights, manifest."""
    from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord, write_checkpoint
    from mpi4dl_nb.data.apps import AppKind
    from mpi4dl_nb.infer.trained import network_task

    model = torch.nn.Sequential(*layers)
    record = RunRecord(spec, DataRecord(AppKind.MEDICAL, image_size, 2, dtype, classes=tuple(classes), mpp=mpp),
                       task=network_task(layers))
    write_checkpoint(directory, record.at(1, "a0b1c2d3e4f5"), model.state_dict(), None)
    return directory


def bright_detector(directory: Path, classes=("dark", "bright"), mpp: float | None = None) -> Path:
    """A ResNet v1 (8 layers, width 4, 32 px patches) whose class 1 probability is ~1 on bright patches
    (mean brightness > 0.6) and ~0 on dark ones: the stem passes the pixels' brightness, every block its
    shortcut only (last BatchNorm zeroed), the head thresholds the patch mean."""
    from mpi4dl_nb.models.spec import ModelSpec

    spec = ModelSpec.of("resnet", num_layers=8, num_filters=4, num_classes=2, resnet_version=1)
    torch.manual_seed(0)
    layers = spec.build(32)
    with torch.no_grad():
        neutral_batchnorms(layers)
        stem = layers[0].conv
        stem.weight.zero_()
        stem.weight[:, :, 1, 1] = 1.0 / 3.0
        for block in layers[1:-1]:
            block.bn2.weight.zero_()
            if not isinstance(block.shortcut, torch.nn.Identity):
                conv = block.shortcut[0]
                conv.weight.zero_()
                for c in range(conv.in_channels):
                    conv.weight[c, c, 0, 0] = 1.0
        fc = layers[-1].fc
        fc.weight.zero_()
        fc.bias.zero_()
        fc.weight[1, 0] = 60.0
        fc.bias[1] = -36.0          # logit 60 * (brightness - 0.6)
    return write_network(directory, layers, spec, 32, classes, mpp)


def unet_checkpoint(directory: Path, classes=("background", "tumor", "stroma"), mpp: float | None = None,
                    depth: int = 2, width: int = 4, seed: int = 0) -> Path:
    """A small U-Net (BatchNorm with non-trivial running statistics, bilinear up-sampling) as a checkpoint."""
    from mpi4dl_nb.models.spec import ModelSpec

    spec = ModelSpec.of("unet", num_layers=depth, num_filters=width, num_classes=len(classes))
    torch.manual_seed(seed)
    layers = spec.build(32)
    with torch.no_grad():
        for module in torch.nn.Sequential(*layers).modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
    return write_network(directory, [layer.double() for layer in layers], spec, 32, classes, mpp)


def square_slide(path: Path, height: int, width: int, square: tuple[int, int, int, int],
                 mpp: float | None = None) -> Path:
    """Dark tissue-coloured glass with one bright square (rows r0:r1, columns c0:c1 of level 0)."""
    image = np.full((height, width, 3), (90, 60, 110), dtype=np.uint8)
    r0, r1, c0, c1 = square
    image[r0:r1, c0:c1] = 250
    return write_slide(path, image, mpp=mpp)


def whole_reference(checkpoint: Path, slide: Path, **read) -> np.ndarray:
    """As ``whole_slide_reference`` for any network (dense too) and any resolution (``SlideReader`` options)."""
    from mpi4dl_nb.infer.reader import SlideReader
    from mpi4dl_nb.infer.trained import load_network as load_trained_network
    from mpi4dl_nb.infer.windows import padded_extent

    trained = load_trained_network(str(checkpoint), dtype=torch.float64)
    net = trained.net
    reader = SlideReader(slide, read.pop("level", None), trained_at=trained.mpp, **read)
    unit = math.lcm(net.shape.stride, net.shape.align)
    height, width = padded_extent(reader.height, unit), padded_extent(reader.width, unit)
    x = torch.from_numpy(reader.read((0, height, 0, width))).permute(2, 0, 1).double().div(255.0)
    with torch.no_grad():
        return net(x[None])[0].numpy()


def neutral_batchnorms(layers: list[torch.nn.Module]) -> None:
    """Every BatchNorm2d of ``layers`` the identity in eval mode (mean 0, variance 1, weight 1, bias 0)."""
    for module in torch.nn.Sequential(*layers).modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.zero_()
            module.running_var.fill_(1.0)
            module.weight.fill_(1.0)
            module.bias.zero_()
