"""Mixed precision (pipeline/precision.py, the spatial conv's operand cast): refusals, loss scaler, autocast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ParallelConfig, PrecisionMode
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.pipeline.precision import LossScaler, autocast, check_precision
from mpi4dl_nb.spatial.conv import autocast_operands

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ctx():
    return Context(trace=False)


def test_choices_and_refusals():
    assert ParallelConfig(precision="bf16").precision is PrecisionMode.BF16
    with pytest.raises(ConfigError, match="fp32, bf16, fp16"):
        ParallelConfig(precision="half")
    with pytest.raises(ConfigError, match="GPU.*bf16"):
        check_precision(PrecisionMode.FP16, CPU, torch.float32)
    with pytest.raises(ConfigError, match="float64"):
        check_precision(PrecisionMode.BF16, CPU, torch.float64)
    check_precision(PrecisionMode.BF16, CPU, torch.float32)
    check_precision(PrecisionMode.FP32, CPU, torch.float64)


def test_autocast_context_and_conv_operands():
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    with autocast(PrecisionMode.BF16, CPU):
        assert nn.functional.conv2d(x, w).dtype == torch.bfloat16
        cast = autocast_operands(x, w, None)
        assert [t.dtype for t in cast[:2]] == [torch.bfloat16, torch.bfloat16] and cast[2] is None
    with autocast(PrecisionMode.FP32, CPU):
        assert nn.functional.conv2d(x, w).dtype == torch.float32
        assert autocast_operands(x, w, None)[0] is x


def test_loss_scaler_unscales_and_skips_non_finite_steps(ctx):
    scaler = LossScaler(scale=8.0, growth_interval=2)
    p = nn.Parameter(torch.ones(3))
    scaler.scaled((p * 2).sum()).backward()
    assert torch.equal(p.grad, torch.full((3,), 16.0))
    assert scaler.unscale(ctx, [p], CPU) and torch.equal(p.grad, torch.full((3,), 2.0))
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert not scaler.unscale(ctx, [p], CPU)
    assert scaler.scale == 4.0 and scaler.skipped == 1
    for _ in range(2):
        p.grad = torch.ones(3)
        assert scaler.unscale(ctx, [p], CPU)
    assert scaler.scale == 8.0


BF16_UNIT = torch.finfo(torch.bfloat16).eps    # one bf16 unit at magnitude 1 (2^-7)


def within_bf16_units(tiled: torch.Tensor, serial: torch.Tensor, units: float) -> None:
    """``tiled`` within ``units`` bf16 units of ``serial``'s largest magnitude, whatever dtype holds them."""
    gap = (tiled.double() - serial.double()).abs().max().item() / (BF16_UNIT * serial.abs().max().item())
    assert gap <= units, f"{gap:.2f} bf16 units apart"


@pytest.mark.parametrize("make", [lambda: nn.ConvTranspose3d(3, 2, 2, 2), lambda: nn.ConvTranspose3d(3, 2, 3, 2, 1, 1),
                                  lambda: nn.ConvTranspose2d(3, 2, 3, 2, 1)], ids=["3d-k2s2", "3d-k3s2", "2d-k3s2"])
def test_transposed_conv_on_a_tile_rounds_like_the_serial_layer_under_bf16(ctx, make):
    """Under autocast the spatial transposed conv sums its bf16 products, the tiles' contributions and the bias in
    float32 and rounds once: its output is the exact sum (float64 over the bf16 operands) rounded to nearest bf16,
    within half a unit of each value (+ 1/16 unit of the largest for float32's summation). Against the serial layer
    the rule is bf16's, not bit-equality: torch's serial bf16 kernels are the CPU's (AVX-512's round once and agree
    bit for bit; AVX2's round partial sums, measured up to 1.7 bf16 units of the output's largest value and 1 unit
    of the weight gradient over 30 seeds), and the gradients, float32 tensors, hold bf16 backward kernels' results.
    So output and gradients are within 2 bf16 units of the serial layer's largest value."""
    from mpi4dl_nb.spatial.convert import spatialize
    from mpi4dl_nb.spatial.geometry import TileGrid

    torch.manual_seed(0)
    layer = make()
    grid = TileGrid(depth=1, rows=1, cols=1) if isinstance(layer, nn.ConvTranspose3d) else TileGrid(1, 1)
    x = torch.randn(2, 3, *[5] * grid.ndim)
    results = []
    for net in (nn.Sequential(layer), spatialize(nn.Sequential(layer), grid, ctx)):
        layer.zero_grad()
        inp = x.clone().requires_grad_()
        with autocast(PrecisionMode.BF16, CPU):
            out = net(inp)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype))
        results.append([out, inp.grad, layer.weight.grad.clone(), layer.bias.grad.clone()])
    assert results[0][0].dtype == results[1][0].dtype == torch.bfloat16
    transposed = nn.functional.conv_transpose3d if grid.ndim == 3 else nn.functional.conv_transpose2d
    exact = transposed(*(t.bfloat16().double() for t in (x, layer.weight, layer.bias)), layer.stride, layer.padding,
                       layer.output_padding)
    torch.testing.assert_close(results[1][0].double(), exact, rtol=BF16_UNIT / 2,
                               atol=BF16_UNIT / 16 * exact.abs().max().item())
    for serial, tiled in zip(results[0], results[1]):
        within_bf16_units(tiled, serial, units=2.0)
