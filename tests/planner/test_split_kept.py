"""The planner's split-backward term: an I keeps, until its W, the output gradient of every module that owns
parameters (pipeline/split_backward.py), and the footprint counts exactly those outputs (one process)."""

from __future__ import annotations

import torch
from torch import nn

from mpi4dl_nb.planner.footprint import _simulate


def test_split_kept_is_the_outputs_of_the_modules_owning_parameters():
    block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(4, 6, 1)).to("meta")
    fp = _simulate(block, [(2, 3, 8, 8)], torch.float32, None, None)
    conv_bn = 2 * (2 * 4 * 8 * 8 * 4)          # the first conv's and BatchNorm's outputs, 8x8
    last = 2 * 6 * 4 * 4 * 4                   # the 1x1 conv after the pool, 4x4
    assert fp.split_kept == conv_bn + last     # ReLU and the pool own nothing: not kept
    assert fp.times(3).split_kept == 3 * fp.split_kept   # an activation term: it scales with the samples
