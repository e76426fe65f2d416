"""Inference test data: a checkpoint written by the real ``train`` command, pyramidal test slides, the
whole-slide reference (the fully convolutional network on the whole zero-extended level, one process)."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import numpy as np
import torch

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


def whole_slide_reference(checkpoint: Path, slide: Path, level: int = 0) -> np.ndarray:
    """The fully convolutional network on the whole (zero-extended) slide level in one process, float64."""
    from mpi4dl_nb.infer.fully_conv import fully_convolutional
    from mpi4dl_nb.infer.model import load_network
    from mpi4dl_nb.infer.reader import SlideReader
    from mpi4dl_nb.infer.windows import padded_extent

    layers, description = load_network(checkpoint, dtype=torch.float64)
    net = fully_convolutional(layers, description.image_size)
    reader = SlideReader(slide, level)
    unit = math.lcm(net.shape.stride, net.shape.align)
    height, width = padded_extent(reader.height, unit), padded_extent(reader.width, unit)
    x = torch.from_numpy(reader.read((0, height, 0, width))).permute(2, 0, 1).double().div(255.0)
    with torch.no_grad():
        return net(x[None])[0].numpy()


def relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-12))
