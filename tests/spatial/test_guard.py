"""The op guard in one process: which operations on tiles pass, which are refused (and how),
and the ways to opt out (check_ops=False, elementwise=, register_op, exact_function)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.convert import spatialize, tile_partial_parameters, tile_replicated_parameters
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.guard import exact_function
from mpi4dl_nb.spatial.ops import register_op, unregister_op
from mpi4dl_nb.spatial.tile_marks import is_tiled


@pytest.fixture(scope="module")
def ctx():
    from mpi4dl_nb.comm.context import Context

    return Context(trace=False)


class Custom(nn.Module):
    """A conv child, then ``op`` in the custom forward."""

    def __init__(self, op) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(1, 4, 1, 1))
        self.op = op

    def forward(self, x):
        return self.op(self, self.conv(x))


def run(ctx, op, **kwargs):
    net = spatialize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Custom(op)), TileGrid(1, 1), ctx, **kwargs)
    return net, net(torch.randn(2, 3, 8, 6))


EXACT = {
    "channel softmax": lambda m, y: y * torch.softmax(y, dim=1),
    "channel mean/max": lambda m, y: y * torch.sigmoid(y.mean(1, keepdim=True) + y.amax(1, keepdim=True)),
    "channel concat and slice": lambda m, y: torch.cat([y[:, :2], y[:, 2:] * 2], dim=1),
    "per-channel parameter": lambda m, y: y * m.scale + 1.0,
    "view keeping the spatial dims": lambda m, y: y.view(2, 2, 2, 8, 6).sum(2).repeat(1, 2, 1, 1),
    "pooled gate (expand_as)": lambda m, y: y * torch.sigmoid(F.adaptive_avg_pool2d(y.detach(), 1) * 0
                                                               + m.scale).expand_as(y),
    "1x1 functional conv": lambda m, y: F.conv2d(y, torch.ones(4, 4, 1, 1)),
    "dropout p=0 / eval batch_norm": lambda m, y: F.batch_norm(F.dropout(y, 0.0), torch.zeros(4),
                                                             torch.ones(4), training=False),
    "iterate the batch": lambda m, y: torch.stack([t * 2 for t in y]),
    "index batch and channels": lambda m, y: y[..., :, :] + y[0:2, None].squeeze(1),
    "templates (to, new_zeros)": lambda m, y: y * m.scale.to(y) + y.new_zeros(y.shape) + y.new_ones(1),
    "channels-last LayerNorm and Linear": lambda m, y: F.linear(
        F.layer_norm(y.permute(0, 2, 3, 1), (4,)), torch.eye(4)).permute(0, 3, 1, 2),
    "flattened and back": lambda m, y: y.flatten(2).transpose(1, 2).transpose(1, 2).reshape(y.shape),
    "global reductions": lambda m, y: y * (y.mean((-1, 2), keepdim=True) + y.amax((2, 3))[..., None, None]
                                           + F.adaptive_max_pool2d(y, 1) + y.flatten(2).sum(-1)[..., None, None]),
    "dropout in training": lambda m, y: F.dropout(y, 0.5) + F.dropout2d(y, 0.5),
    "training batch_norm": lambda m, y: F.batch_norm(y, None, None, m.scale.view(4), None, training=True),
    "interpolate to a tile's size": lambda m, y: F.interpolate(y, size=y.shape[-2:], mode="bilinear"),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_ops_pass_and_stay_tiles(ctx, name):
    _, out = run(ctx, EXACT[name])
    assert out.shape[-2:] == (8, 6)
    assert is_tiled(out)


REFUSED = {
    "F.lp_pool2d": lambda m, y: F.lp_pool2d(y, 2, 3, 1),     # (F.max_pool2d / F.avg_pool2d are exact)
    "F.interpolate (nearest-to-bigger, then sliced)": lambda m, y: F.interpolate(y, scale_factor=2)[..., ::2, ::2],
    "torch.flip": lambda m, y: torch.flip(y, (2,)),
    "Tensor.sum": lambda m, y: y - y.sum(2, keepdim=True),                # over one image axis only
    "F.pad": lambda m, y: F.pad(y, (1, 1, 1, 1)),
    "Tensor.flatten": lambda m, y: y.flatten(1).sum(1),                     # mixes channels and pixels
    "Tensor.view": lambda m, y: y.view(2, 4, 6, 8),                         # rows and columns mixed
    "F.linear": lambda m, y: F.linear(y, torch.ones(6, 6)),
    "conv2d": lambda m, y: F.conv2d(y, torch.ones(4, 4, 3, 3), padding=1),
    "F.alpha_dropout": lambda m, y: F.alpha_dropout(y, 0.5, training=True),
    "torch.rand_like": lambda m, y: y * torch.rand_like(y),
    "Tensor.__getitem__ (channels-last)": lambda m, y: y.permute(0, 2, 3, 1)[:, 1:].sum(),
    "Tensor.item": lambda m, y: y * y[:1].sum(1).tolist()[0][0][0],       # a global y.max() is fine
    "Tensor.T": lambda m, y: y.mT,
    "torch.cat": lambda m, y: torch.cat([y, torch.ones(2, 1, 8, 6)], dim=1),
    "F.interpolate": lambda m, y: F.interpolate(y, size=(y.shape[-2] * 2, y.shape[-1])),   # tile's or image's?
    "Tensor.add (arange)": lambda m, y: y + torch.arange(6.0),             # varies along the width
    "Tensor.reshape (the image's token count)": lambda m, y: y.reshape(2, 4, -1, 96),   # torch raises on a tile
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_ops_name_module_and_op(ctx, name):
    with pytest.raises(ConfigError) as error:
        run(ctx, REFUSED[name])
    text = str(error.value)
    assert "layer '1' (Custom)" in text, text
    shown = name.split(" ")[0].replace("Tensor.T", "Tensor.mT")
    if name not in ("Tensor.item", "F.interpolate (nearest-to-bigger, then sliced)"):
        assert shown in text, text
    assert "move this computation after the spatial stage" in text


def test_check_ops_false_skips_the_checks(ctx):
    _, out = run(ctx, REFUSED["torch.flip"], check_ops=False)
    assert out.shape == (2, 4, 8, 6)


def test_register_op_and_exact_function(ctx):
    op = lambda m, y: torch.special.expit(y)   # noqa: E731 - not in the table: refused
    with pytest.raises(ConfigError, match="not known"):
        run(ctx, op)
    register_op(torch.special.expit)
    try:
        run(ctx, op)
    finally:
        unregister_op(torch.special.expit)

    @exact_function
    def shifted(y):
        return torch.roll(y, 1, dims=1)    # a channel roll written with a refused-looking call

    seen = []

    def use(m, y):
        out = shifted(y)
        seen.append(is_tiled(out))
        return out

    run(ctx, use)
    assert seen == [True]


def test_registered_module_runs_unchecked_and_its_parameters_are_tile_shares(ctx):
    class Shift(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return torch.roll(x, 1, dims=1) * self.gain

    net = spatialize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Shift()), TileGrid(1, 1), ctx,
                     elementwise=(Shift,))
    net(torch.randn(1, 3, 5, 5))
    assert any(p is net[1].gain for p in tile_partial_parameters(net))


def test_layers_on_pooled_values_hold_full_gradients(ctx):
    from tests.support.dense_models import SqueezeExcite

    net = spatialize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), SqueezeExcite(4, conv=True)),
                     TileGrid(1, 1), ctx)
    net(torch.randn(2, 3, 6, 6)).sum().backward()
    replicated = {id(p) for p in tile_replicated_parameters(net)}
    assert {id(p) for p in net[1].parameters()} == replicated      # the gate's 1x1 convs
    assert {id(p) for p in net[0].parameters()} == {id(p) for p in tile_partial_parameters(net)}


def test_a_layer_used_on_tiles_and_on_pooled_values_is_refused(ctx):
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)
            self.pool = nn.AdaptiveAvgPool2d(1)

        def forward(self, x):
            return self.conv(x) * self.conv(self.pool(x))

    net = spatialize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Both()), TileGrid(1, 1), ctx)
    with pytest.raises(ConfigError, match="both on image tiles and on a replicated"):
        net(torch.randn(1, 3, 5, 5))


def test_guard_is_left_after_an_error(ctx):
    with pytest.raises(ConfigError):
        run(ctx, REFUSED["F.pad"])
    assert torch.flip(torch.ones(2, 2), (0,)).shape == (2, 2)    # no mode left behind
    assert not torch.overrides._get_current_function_mode_stack()
