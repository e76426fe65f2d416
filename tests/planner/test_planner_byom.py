"""Planner memory for models nobody here wrote (torchvision): the one-process estimate against the measured peak
of a training step in this process. EfficientNet-B0 as torchvision builds it (depthwise convs, SiLU,
squeeze-excitation, stochastic depth, dropout) and a small torchvision ConvNeXt (the ConvNeXt-T blocks at
fewer channels: LayerNorm over permuted channels, GELU, layer scale, stochastic depth, and its maps laid out
channels-last after each block, which changes what the depthwise 7x7 conv's backward allocates). Every rank
of parallel layouts, the full-size models: ``benchmarks/bench_planner.py --byom`` (BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.models import layer_list
from mpi4dl_nb.planner.layouts import BackendLayouts
from mpi4dl_nb.planner.live_bytes import LiveBytes
from mpi4dl_nb.planner.workspace import channels_last
from tests.support.planner_checks import serial_peak
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

MB = 2 ** 20


def torchvision_or_skip() -> None:
    require_or_skip(missing_modules("torchvision"), "planner estimates of torchvision models", MODELS_EXTRA)


def efficientnet_b0() -> list[nn.Module]:
    """torchvision's EfficientNet-B0 (2 classes) cut as ``--model torchvision:efficientnet_b0`` cuts it."""
    from torchvision.models import efficientnet_b0 as build

    return layer_list(build(weights=None, num_classes=2))


def small_convnext() -> list[nn.Module]:
    """torchvision's ConvNeXt at 16-32-64 channels, two blocks a stage (stochastic depth 0.1), cut the same way."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return layer_list(ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, 64, 2), CNBlockConfig(64, None, 2)],
                               stochastic_depth_prob=0.1, num_classes=2))


# image size and batch where activations, not the weights, make the peak (so a missed layer term shows)
@pytest.mark.parametrize("build,size,batch", [(efficientnet_b0, 128, 2), (small_convnext, 96, 4)])
def test_one_process_estimate_of_a_torchvision_model_within_15_percent_of_measured(build, size, batch):
    torchvision_or_skip()
    torch.manual_seed(0)
    layers = build()
    plan = planner.estimate_memory(layers, ParallelConfig(split_size=1, spatial_size=0), size, batch)
    rank = plan.ranks[0]
    assert "backward" in rank.moment and rank.activations > rank.weights, rank.as_dict()
    measured = serial_peak(nn.Sequential(*layers), batch, size, profile_warmup=False)
    assert abs(plan.peak / measured - 1) < 0.15, (build.__name__, plan.peak / MB, measured / MB)


def test_shape_only_convolutions_keep_a_channels_last_layout_and_fixed_scratch_stays_fixed():
    conv = nn.Conv2d(8, 8, 7, padding=3, groups=8).to("meta")
    x = torch.empty(2, 8, 16, 16, device="meta", memory_format=torch.channels_last)
    assert not channels_last(conv(x))                          # what meta alone gives
    with BackendLayouts():
        assert channels_last(conv(x))                          # what oneDNN and cuDNN give
        assert not channels_last(conv(x.contiguous()))
    live = LiveBytes()
    with live:
        grows = torch.empty(1000, device="meta")
        stays = torch.empty(24, device="meta")
        live.mark_fixed(stays)                                 # a peak moment: counted among the peak's fixed bytes
        assert (live.peak, live.fixed_at_peak) == (4096, 96)
        del stays
        assert live.fixed == 0 and live.current == 4000 and grows.numel() == 1000


def test_a_depthwise_conv_on_a_channels_last_map_allocates_in_its_backward_what_the_simulation_says():
    """oneDNN's backward of a depthwise conv on a channels-last map (ConvNeXt's) holds many partial weight
    gradients at once (65 with torch 2.14 here, 256 with 2.13): the count measured on the 7x7 probe predicts
    a 5x5 conv of other channels, batch and map size."""
    from mpi4dl_nb.measure.steps import measure_peak_bytes
    from mpi4dl_nb.planner.footprint import StageRole
    from mpi4dl_nb.planner.tile_footprints import simulate_layer

    torch.manual_seed(0)
    conv = nn.Conv2d(48, 48, 5, padding=2, groups=48)
    x = torch.randn(3, 48, 24, 24).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    out = conv(x)
    grad = torch.ones_like(out)
    _, measured = measure_peak_bytes(lambda: out.backward(grad))
    (fp,) = simulate_layer(conv, [(3, 48, 24, 24)], torch.float32, StageRole(), layouts=(True,))
    simulated = fp.backward_peak - 2 * fp.output_bytes       # the output and its gradient existed before
    assert abs(simulated / measured - 1) < 0.1, (simulated, measured)
    assert fp.backward_fixed >= 16 * conv.weight.numel() * 4    # the partial gradients do not grow with the batch
