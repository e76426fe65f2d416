"""SpatialConv: nn.Conv2d / nn.Conv3d on a tile, its halo exchanged first (any kernel, stride, dilation, groups).

One implementation over the grid's tiled axes. Three ways to the same values, none keeping the extended
tile for backward (it would double the bytes next to the previous layer's saved output): a stride-1 conv
whose halo is its own reach runs banded (``halo_conv.py``: the owned tile natively padded plus thin bands
around the strips); other convs by regions (``regional.py``: interior from the owned tile, boundary bands
from small boxes); what has no interior on the extended tile, saving the owned tile and the strips and
rebuilding the extended tile in backward without messages.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError
from .batchnorm_fn import LOW_PRECISION
from .geometry import KernelAxis
from .halo import HaloExchange
from .halo_conv import TileConv, band_paddings, banded_conv, conv_gradients, convolve, extended_conv, padded_conv
from .kernel_layer import Inside, SpatialKernelLayer
from .layer import SpatialRuntime, adopt
from .regional import Padding, Params, plan_for, windowed_by_regions

# Halo overlap: banded convs compute the owned tile, region convs/pools their interior, while
# the first phase's halos are in flight. Off by default: on one node the messages are ~1-8% of a forward
# and measured no gain (BENCHMARKS.md §2d); worth switching on where messages take
# longer (networks).
HALO_OVERLAP = False
# Strided/dilated/asymmetric convs and max/avg pools by regions (spatial/regional.py), not on
# a copied extended tile; False forces the extended path (benchmarks and tests compare both).
REGIONS = True


def conv_axis_windows(conv: nn.modules.conv._ConvNd) -> tuple[KernelAxis, ...]:
    """The window of a Conv2d/Conv3d along each of its spatial axes (explicit, 'valid' or 'same' padding)."""
    if conv.padding_mode != "zeros":
        raise ConfigError("model", f"{type(conv).__name__} padding_mode={conv.padding_mode!r} is not "
                          f"supported by spatial parallelism; use padding_mode='zeros'")
    windows = []
    for axis in range(len(conv.kernel_size)):
        k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
        if isinstance(conv.padding, str):
            total = d * (k - 1) if conv.padding == "same" else 0
            before, after = total // 2, total - total // 2
        else:
            before = after = conv.padding[axis]
        windows.append(KernelAxis(k, s, d, before, after))
    return tuple(windows)


def autocast_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under autocast, the conv's operands in the compute dtype (as autocast casts them for
    F.conv2d; differentiable casts), so the halo travels, the tile is saved and backward runs
    in that dtype as in the serial model; unchanged otherwise."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return x, weight, bias
    return x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None


def autocast_kind(x: torch.Tensor) -> str:
    """The autocast device type of ``x``'s device."""
    return x.device.type if x.device.type in ("cpu", "cuda") else "cpu"


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes an op on ``x`` in (bf16/fp16), None when autocast is off or ``x`` is float64."""
    kind = autocast_kind(x)
    if not torch.is_autocast_enabled(kind) or x.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(kind)


class SpatialConv(SpatialKernelLayer, nn.modules.conv._ConvNd):
    """nn.Conv2d / nn.Conv3d on this rank's tile: exchange the halo (zero padding at image borders), then
    convolve without padding; the result is exactly the owned output range."""

    @classmethod
    def from_module(cls, conv: nn.Conv2d | nn.Conv3d, runtime: SpatialRuntime, name: str = "") -> SpatialConv:
        new = adopt(cls, conv, runtime, name)
        new.windows = conv_axis_windows(conv)
        return new

    def apply_padded(self, y: torch.Tensor, inside: Inside | None = None) -> torch.Tensor:
        """The convolution on an input that already holds its halo and zero padding."""
        y, weight, bias = autocast_operands(y, self.weight, self.bias)
        return convolve(self, y, weight, bias)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv_after_exchange(self, x, self.exchange_for(x))


class ConvPieces:
    """A conv layer's convolution on pieces of its extended input (a ``RegionOp``; of the conv it reads only the
    kernel size, stride, dilation and groups)."""

    reads_input = True

    def __init__(self, conv: TileConv) -> None:
        self.conv = conv
        self.spans = tuple(d * (k - 1) + 1 for k, d in zip(conv.kernel_size, conv.dilation))
        self.strides = tuple(conv.stride)
        self.pad_caps: tuple[int | None, ...] = (None,) * len(conv.kernel_size)

    def run(self, piece: torch.Tensor, params: Params, padding: Padding) -> torch.Tensor:
        weight, bias = params
        assert weight is not None
        return convolve(self.conv, piece, weight, bias, padding)

    def run_saving(self, piece: torch.Tensor, params: Params, padding: Padding
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.run(piece, params, padding), None

    def grads(self, grad: torch.Tensor, piece: torch.Tensor, params: Params, padding: Padding,
              mask: list[bool], saved: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list]:
        weight, bias = params
        assert weight is not None
        has_bias = bias is not None
        wanted = [mask[0], mask[1], has_bias and mask[2]]
        grad_in, grad_w, grad_b = conv_gradients(self.conv, grad, piece, weight, has_bias, padding, wanted)
        return (grad_in if wanted[0] else None,
                [grad_w if wanted[1] else None, grad_b if wanted[2] else None])


def conv_after_exchange(conv: SpatialConv, x: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:
    """``conv`` on the owned tile ``x`` through ``exchange`` (memory-lean autograd)."""
    if exchange.identity:
        return conv.apply_padded(x)
    x, weight, bias = autocast_operands(x, conv.weight, conv.bias)
    # banded adds a correction to the boundary outputs: in bf16/fp16 that rounds them twice where the serial conv
    # rounds once (past the bf16 rule on volumes' many boundary voxels); by regions every output is one conv's
    pads = None if x.dtype in LOW_PRECISION else band_paddings(conv, exchange)
    if pads is not None:
        return banded_conv(x, weight, bias, conv, exchange, pads, HALO_OVERLAP)
    if REGIONS:
        op = ConvPieces(conv)
        plan = plan_for(op, exchange)
        if plan is not None:
            return windowed_by_regions(x, op, exchange, plan, HALO_OVERLAP, (weight, bias))
    return extended_conv(x, weight, bias, conv, exchange)


def conv_after_padding(conv: SpatialConv, y: torch.Tensor, pads: tuple[int, ...]) -> torch.Tensor:
    """``conv`` on ``y`` zero-padded by ``pads`` (``F.pad``'s: before, after per axis, last axis first),
    memory-lean."""
    if not any(pads):
        return conv.apply_padded(y)
    y, weight, bias = autocast_operands(y, conv.weight, conv.bias)
    return padded_conv(y, weight, bias, conv, pads)
