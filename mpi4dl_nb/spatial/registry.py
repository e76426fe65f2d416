"""The torch layers' three families: layers with a spatial version, guarded and element-wise layers.

``SPATIAL_LAYERS``, a table behind one record, gives each of its thirty torch classes its spatial class and tiled axes
(which the converter's refusal of an unlisted torch layer names: ``converted_on``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError
from .conv import SpatialConv
from .convtranspose import SpatialConvTranspose
from .family import Family, of_types
from .layer import Convert, SpatialRuntime
from .norm import SpatialBatchNorm, SpatialGroupNorm, SpatialInstanceNorm
from .pool import SpatialAvgPool, SpatialGlobalAvgPool, SpatialGlobalMaxPool, SpatialMaxPool
from .upsample import SpatialUpsample


@dataclass(frozen=True)
class Conversion:
    """How ``spatialize`` converts a torch layer: ``make(layer, runtime, name)`` builds its spatial version around
    the layer's own parameters and buffers; ``axes``: the tiled axes the layer works on (2: an image's grid, 3:
    a volume's), None: any grid."""

    make: Callable[..., nn.Module]
    axes: int | None = None


def _twins(make: Callable[..., nn.Module], image: type[nn.Module], volume: type[nn.Module]
           ) -> dict[type[nn.Module], Conversion]:
    return {image: Conversion(make, 2), volume: Conversion(make, 3)}


# torch layer type -> its conversion; one spatial class serves the 2-D and the 3-D torch layer of a kind. Dropout
# runs as it is on either grid (GUARDED: the guard computes each tile's slice of the serial mask).
SPATIAL_LAYERS: dict[type[nn.Module], Conversion] = {
    **_twins(SpatialConv.from_module, nn.Conv2d, nn.Conv3d),
    **_twins(SpatialConvTranspose.from_module, nn.ConvTranspose2d, nn.ConvTranspose3d),
    **_twins(SpatialMaxPool.from_module, nn.MaxPool2d, nn.MaxPool3d),
    **_twins(SpatialAvgPool.from_module, nn.AvgPool2d, nn.AvgPool3d),
    **_twins(SpatialBatchNorm.from_module, nn.BatchNorm2d, nn.BatchNorm3d),
    **_twins(SpatialInstanceNorm.from_module, nn.InstanceNorm2d, nn.InstanceNorm3d),
    **_twins(SpatialGlobalAvgPool.from_module, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
    **_twins(SpatialGlobalMaxPool.from_module, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
    nn.GroupNorm: Conversion(SpatialGroupNorm.from_module),
    nn.Upsample: Conversion(SpatialUpsample.from_module),
}


def converted_on(axes: int) -> list[type[nn.Module]]:
    """The torch layers ``spatialize`` converts on a grid of ``axes`` tiled axes."""
    return [kind for kind, conversion in SPATIAL_LAYERS.items() if conversion.axes in (None, axes)]


# Layers that act on each pixel (or on replicated, already pooled tensors) independently.
# They run under the op guard, which refuses them on tiles when they are not (nn.Linear).
ELEMENTWISE: tuple[type, ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
    nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
    nn.Softplus, nn.Flatten, nn.Linear, nn.PReLU, nn.Softmax, nn.LogSoftmax, nn.ChannelShuffle,
)

# Torch layers that run as they are: the op guard computes their functional op exactly on tiles
# (dropout: the serial mask's slice; LayerNorm/RMSNorm over channels-last tiles; a Conv1d on pooled values, as
# ECA's gate) or refuses it, naming the layer.
# Never fused into halo-D2 blocks.
GUARDED: tuple[type, ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
    nn.LayerNorm, nn.RMSNorm, nn.Conv1d,
)


def convert_torch_layer(module: nn.Module, name: str, runtime: SpatialRuntime, _: Convert) -> nn.Module:
    """A layer of ``SPATIAL_LAYERS`` as its spatial version (its parameters' gradients tile shares); refused on a grid
    of other tiled axes than its own, naming what is supported there."""
    kind = type(module)
    conversion = SPATIAL_LAYERS[kind]
    if conversion.axes not in (None, runtime.grid.ndim):
        what = "a volume's tiles (a TileGrid with depth)" if runtime.grid.volumetric else "image tiles"
        supported = ", ".join(t.__name__ for t in converted_on(runtime.grid.ndim))
        raise ConfigError("model", f"layer {name or '<root>'!r} ({kind.__name__}) is not supported on "
                          f"{what}; supported there: {supported}, element-wise layers and containers of them; "
                          f"or put it after the spatial stage")
    converted = conversion.make(module, runtime, name)
    runtime.partial_parameters.extend(p for p in module.parameters(recurse=False))
    return converted


def pass_guarded(module: nn.Module, name: str, runtime: SpatialRuntime, _: Convert) -> nn.Module:
    """A GUARDED layer as it is (the guard computes its op on tiles); refused up front where the guard would refuse
    it at the first forward."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        shape = tuple(module.normalized_shape or ())
        if len(shape) > 1:   # the last dims of any tile it could see hold a row or column
            raise ConfigError("model", f"layer {name!r} ({type(module).__name__}, normalized_shape="
                              f"{list(shape)}) normalises over the image's rows or columns of each tile; "
                              f"normalise over channels only (permute the channels last first, as "
                              f"ConvNeXt does), use GroupNorm or BatchNorm2d (whose statistics span every "
                              f"tile), or put it after the spatial stage")
    return module


TORCH_LAYERS = Family("torch layers with a spatial version (registry.SPATIAL_LAYERS)", of_types(SPATIAL_LAYERS),
                      convert_torch_layer, "tests/mpi/spatial_exactness.py")
GUARDED_LAYERS = Family("guarded torch layers (registry.GUARDED: dropout, LayerNorm, RMSNorm, Conv1d)",
                        of_types(GUARDED), pass_guarded, "tests/mpi/spatial_families.py")
ELEMENTWISE_LAYERS = Family("element-wise torch layers (registry.ELEMENTWISE)", of_types(ELEMENTWISE),
                            lambda module, *_: module, "tests/mpi/spatial_correctness.py")
