"""Activation memory of volumes on tiles: the 8-rank launch of tests/mpi/volume_memory.py (the conv stack's bytes
per rank <= 1.15/P of one process for P = 2, 4, 8: issue 45's acceptance line), and the measure on one process."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.support.volume_memory import Measured, conv_stack3d, step_peak
from tests.mpi import volume_memory
from tests.support.battery import shared_job

JOB = shared_job(volume_memory.WORLD, "volume_memory", timeout=240)


def test_conv_stack_activation_bytes_per_rank_within_1_15_over_p(shared_launch):
    shared_launch(JOB).require_clean(volume_memory.CHECKS)


def test_step_peak_counts_what_autograd_keeps_and_measured_lines_compare_with_the_bound():
    torch.manual_seed(0)
    stack = nn.Sequential(*conv_stack3d(channels=2, convs=2)).double()
    x = torch.rand(1, 1, 6, 6, 6, dtype=torch.float64)
    # conv 1 keeps x (1 channel), ReLU 1 keeps its output (2 channels, conv 2's input too), ReLU 2 its output
    assert step_peak(stack, x) == 6 ** 3 * 8 * (1 + 2 + 2)
    found = Measured(1000, {2: [560, 500], 4: [300, 250, 250, 250]})
    assert found.within_bound(2) and not found.within_bound(4)
    lines = found.lines("stack")
    assert "ratio 0.5600 <= bound 1.15/P = 0.5750: yes" in lines[1] and ": NO" in lines[2]
