"""SpatialConvTranspose: nn.ConvTranspose2d / 3d on tiles (any stride, padding, output_padding).

A transposed convolution scatters each input pixel into a ``d*(k-1)+1`` window of the output
at stride ``s``. Each tile computes its full local contribution (a transposed conv with no
padding), which covers output rows ``[i0*s - p, (i1-1)*s - p + d*(k-1) + 1)`` for input rows
``[i0, i1)``. The rows that fall in a neighbour's owned output range are sent there and added;
rows outside the image (the padding) are dropped. That is exactly the adjoint of a halo
exchange whose "needed" range is the contribution range, so forward runs the halo
exchange's adjoint and backward its forward (the gradient's halo). The same code serves an image's
two tiled axes and a volume's three.
"""

from __future__ import annotations

from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .conv import autocast_dtype, autocast_kind
from .geometry import AxisExchange, LayerHalo, plan_axis, split_ranges
from .layer import SpatialLayer, SpatialRuntime, adopt


def contribution_plan(size: int, parts: int, kernel: int, stride: int, dilation: int,
                      padding: int, output_padding: int, what: str) -> tuple[int, list[AxisExchange]]:
    """Output length and, per tile, the exchange plan of its contribution range along one axis."""
    out = (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
    if out < parts or size < parts:
        raise ConfigError("num_spatial_parts", f"{what}: input length {size} / output length {out} "
                          f"cannot be split into {parts} non-empty tiles; use fewer spatial parts "
                          f"or a larger image_size")
    reach = dilation * (kernel - 1) + 1
    needed = [(i0 * stride - padding, (i1 - 1) * stride - padding + reach)
              for i0, i1 in split_ranges(size, parts)]
    return out, plan_axis(out, split_ranges(out, parts), needed, what=what)


class SpatialConvTranspose(SpatialLayer, nn.Module):
    """nn.ConvTranspose2d / nn.ConvTranspose3d on this rank's tile, over the grid's 2 or 3 axes; its output is
    the owned tile of the full output."""

    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: str | tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int
    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def from_module(cls, conv: nn.ConvTranspose2d | nn.ConvTranspose3d, runtime: SpatialRuntime,
                    name: str = "") -> Self:
        if conv.padding_mode != "zeros":
            raise ConfigError("model", f"{name}: {type(conv).__name__} padding_mode={conv.padding_mode!r} "
                              f"is not supported; use 'zeros'")
        return adopt(cls, conv, runtime, name)

    def geometry(self, sizes: tuple[int, ...]) -> LayerHalo:
        grid = self.runtime.grid
        axis_names = grid.axis_names
        outs, plans = [], []
        for axis, (size, parts) in enumerate(zip(sizes, grid.shape)):
            out, plan = contribution_plan(
                size, parts, self.kernel_size[axis], self.stride[axis], self.dilation[axis],
                int(self.padding[axis]), self.output_padding[axis], f"{self.layer_name} ({axis_names[axis]})")
            outs.append(out)
            plans.append(plan)
        return LayerHalo.from_axis_plans(grid, sizes, outs, plans, self.layer_name)

    def tile_forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if output_size is not None:
            raise ConfigError("model", f"{self.layer_name}: {self.serial_class.__name__}(output_size=...) is "
                              f"not supported on tiles (a tile's size is not the image's); set "
                              f"output_padding on the layer instead")
        compute = autocast_dtype(x)
        if compute is None:
            return self._contributed(x, self.weight, self.bias)
        # under autocast, as the serial layer: operands rounded to the compute dtype, the products summed (the
        # tiles' contributions included) and the bias added in float32, the output rounded once
        with torch.autocast(autocast_kind(x), enabled=False):
            bias = None if self.bias is None else self.bias.to(compute).float()
            return self._contributed(x.to(compute).float(), self.weight.to(compute).float(), bias).to(compute)

    def _contributed(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Each tile's contribution, the neighbours' parts sent to their owners and added, then the bias."""
        runtime = self.runtime
        sizes = runtime.axis_sizes(self, x)
        exchange = self._halo(sizes, lambda: runtime.exchange(self.geometry(sizes), 0.0))
        transposed = F.conv_transpose3d if runtime.grid.volumetric else F.conv_transpose2d
        out = exchange.adjoint(transposed(x, weight, None, self.stride, 0, 0, self.groups, self.dilation))
        if bias is not None:
            out = out + bias.reshape(-1, *[1] * runtime.grid.ndim)
        return out
