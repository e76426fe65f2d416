"""The planner's split-backward terms (footprint ``SplitTerms``): a layer run through the engine's own I and W
(pipeline/split_backward.py) on meta; what I keeps for W is each parameter module's output gradient, each
storage once (one process)."""

from __future__ import annotations

import torch
from torch import nn

from mpi4dl_nb.planner.footprint import SplitRun, _simulate, compose_stage


class TwoBranches(nn.Module):
    """conv_a(x) + conv_b(x): the add hands both convolutions the same output gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_a, self.conv_b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_a(x) + self.conv_b(x)


def test_split_kept_is_the_outputs_of_the_modules_owning_parameters():
    block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(4, 6, 1)).to("meta")
    fp = _simulate(block, [(2, 3, 8, 8)], torch.float32, None, None, split=SplitRun.SPLIT)
    conv_bn = 2 * (2 * 4 * 8 * 8 * 4)          # the first conv's and BatchNorm's outputs, 8x8
    last = 2 * 6 * 4 * 4 * 4                   # the 1x1 conv after the pool, 4x4: the gradient it was handed
    assert fp.split.kept == conv_bn + last     # ReLU and the pool own nothing: not kept
    assert fp.split.kept_received == last
    assert fp.split.input_peak >= fp.split.kept   # the kept gradients are made during I
    assert fp.times(3).split.kept == 3 * fp.split.kept   # an activation term: it scales with the samples
    assert _simulate(block, [(2, 3, 8, 8)], torch.float32, None, None).split.kept == 0   # only when asked


def test_an_add_hands_both_branches_one_gradient_kept_once():
    """The overestimate the first model had (zb1 rank 0 at 1.25 of measured): the output gradients of the two
    convolutions before an add are one tensor, counted once; the stage output goes after I (only the node
    after the last parameter module held it), the received gradient stays (it is that kept tensor)."""
    fp = _simulate(TwoBranches().to("meta"), [(2, 3, 8, 8)], torch.float32, None, None, split=SplitRun.SPLIT)
    out = 2 * 4 * 8 * 8 * 4
    assert fp.split.kept == fp.split.kept_received == out
    stage = compose_stage([fp], grad_held=True, split=True)
    assert stage.split is not None
    assert stage.split.kept == out
    assert stage.split.held == stage.retained - out   # the output, held by the runtime until I, went with it
