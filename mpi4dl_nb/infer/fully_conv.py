"""A trained classifier as a fully convolutional network (FCN), and the receptive field of its output cells.

The classifier ``trunk -> [BN] -> [ReLU] -> global average pool -> linear`` becomes
``trunk -> [BN] -> [ReLU] -> 1x1 conv (the linear's weights) -> K x K average pool (stride t)
-> softmax over classes``, with ``K`` the trunk's feature-map side at the training image size.
The linear map and the mean commute, so a cell whose pooling window covers exactly a
training-size patch of features gives the classifier's probabilities for those features;
its features, unlike a patch classified alone, see the slide around the patch (no padding
at the patch's edges). Dense models (a per-pixel ``(N, classes, h, w)`` output) only get
the softmax. The field of a cell is measured, not assumed: NaN written beyond an edge of a
probe image reaches exactly the cells whose value depends on pixels there.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ConfigError
from ..models.head import ClassifierHead
from ..models.named_pool import replaced_pool
from ..models.pools import PoolKind
from .pooled_head import head_on_cells, pooled_head
from .windows import AxisField

PROBE_CHUNK = 4          # probe images per forward (bounds the probe's memory)
PROBE_MAX_PIXELS = 1 << 16


@dataclass(frozen=True)
class NetworkShape:
    """What the window geometry needs to know of an FCN: output stride, alignment, smallest input."""

    stride: int        # input pixels per output cell
    align: int         # window origins are multiples of this
    min_side: int      # smallest input side that gives one output cell
    classes: int
    dims: int = 2      # spatial axes: 2 (an image) or 3 (a volume)


@dataclass(frozen=True)
class WindowPool:
    """Where a classifier's FCN pools: module ``index`` pools ``window`` x ``window`` feature cells every ``step``;
    the modules before it and the ones after it act on each cell alone."""

    index: int
    window: int
    step: int


class FullyConvolutional(nn.Sequential):
    """``trunk..., head..., Softmax(dim=1)``: probabilities per class for every output cell."""

    shape: NetworkShape
    pool: WindowPool | None = None     # a classifier's window pool (None: a dense network)


VOLUME_MODULES = (nn.Conv3d, nn.ConvTranspose3d, nn.MaxPool3d, nn.AvgPool3d, nn.BatchNorm3d, nn.InstanceNorm3d)
WINDOWED = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d)


def spatial_dims(layers: Sequence[nn.Module]) -> int:
    """3 for a volume network (any 3-D conv, pool or norm), else 2."""
    return 3 if any(isinstance(m, VOLUME_MODULES) for layer in layers for m in layer.modules()) else 2


def meta_output_shape(module: nn.Module, channels: int, sizes: Sequence[int],
                      dtype: torch.dtype = torch.float32) -> torch.Size:
    """The shape of ``module``'s output for one ``channels`` x ``sizes`` input (meta device: no compute)."""
    probe = copy.deepcopy(module).to("meta")
    with torch.no_grad():
        return probe(torch.empty(1, channels, *sizes, device="meta", dtype=dtype)).shape


PROBE_SIDE = 4096 * 315   # divisible by every stride product a CNN is likely to have
PROBE_THIN = 40320        # a volume probe's other axes (8!: its element count stays within int64)


def _strides(module: nn.Module, channels: int, dtype: torch.dtype, dims: int = 2) -> list[int]:
    """Cumulative stride after every conv/pool: its input's stride (from sizes on the meta device) x its own."""
    found: list[int] = []
    probe = copy.deepcopy(module).to("meta")

    def hook(mod: nn.Module, inputs: tuple) -> None:
        width = int(inputs[0].shape[-1])
        if all(int(n) == 1 for n in inputs[0].shape[2:]):     # a pooled vector (a squeeze-excitation gate): no grid
            return
        stride = getattr(mod, "stride", None)
        own = getattr(mod, "kernel_size", 1) if stride is None else stride   # a pool's stride defaults to its kernel
        own = own[-1] if isinstance(own, (tuple, list)) else own
        found.append(max(1, round(PROBE_SIDE / max(width, 1))) * int(own))

    handles = [m.register_forward_pre_hook(hook) for m in probe.modules() if isinstance(m, WINDOWED)]
    sides = (PROBE_SIDE, PROBE_SIDE) if dims == 2 else (PROBE_THIN,) * (dims - 1) + (PROBE_SIDE,)
    with torch.no_grad():
        probe(torch.empty(1, channels, *sides, device="meta", dtype=dtype))
    for handle in handles:
        handle.remove()
    return found


def head_as_convolution(head: ClassifierHead, window: int, stride: int) -> list[nn.Module]:
    """``[BN] [ReLU] 1x1 conv avgpool(window, stride)``: the head applied to every ``window``-sized feature patch."""
    fc = head.fc
    conv = nn.Conv2d(fc.in_features, fc.out_features, 1, bias=True).to(fc.weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(fc.weight[:, :, None, None])
        conv.bias.copy_(fc.bias)   # type: ignore[union-attr]  # bias=True
    return [head.norm, head.relu, conv, nn.AvgPool2d(window, stride=stride)]


def fully_convolutional(layers: Sequence[nn.Module], patch: int | None, *, channels: int = 3,
                        output_stride: int | None = None) -> FullyConvolutional:
    """The FCN of a layer list (in eval mode, sharing its weights).

    Classifiers (last layer a ``ClassifierHead``, or a cut model's pooled head: ``pooled_head.py``) need
    ``patch``, the training image side;
    ``output_stride`` (pixels per cell, a multiple of the trunk's stride; default the trunk's)
    sets the pooling stride. Dense models give per-pixel probabilities.
    """
    layers = list(layers)
    dtype = next((p.dtype for layer in layers for p in layer.parameters()), torch.float32)
    dims = spatial_dims(layers)
    head = pooled_head(layers)
    slide_pool = layers[-1].pool_kind if isinstance(layers[-1], ClassifierHead) else replaced_pool(layers)
    if slide_pool is not None and slide_pool is not PoolKind.AVG:
        raise ConfigError("--checkpoint", f"its head pools the whole canvas by {slide_pool.value} (--pool), "
                                          f"which a map of cells cannot reproduce; a whole-slide model (train "
                                          f"--whole-slide) gets one prediction per slide with `infer --slides "
                                          f"A,B --output DIR`; evaluate others with `evaluate --checkpoint`")
    if dims == 3 and (isinstance(layers[-1], ClassifierHead) or head is not None):
        raise ConfigError("--checkpoint", "a volume classifier cannot be streamed as a map of cells yet; "
                                          "volume inference takes dense (per-voxel) networks such as --model unet3d")
    if isinstance(layers[-1], ClassifierHead) or head is not None:
        trunk = nn.Sequential(*layers[:-1])
        if patch is None or patch < 1:
            raise ConfigError("--checkpoint", "a classifier's checkpoint must record the training image size")
        feat = meta_output_shape(trunk, channels, (patch, patch), dtype)
        side = int(feat[-1])
        if side < 1 or patch % side or int(feat[-2]) != side:
            raise ConfigError("--checkpoint", f"the trunk maps {patch}x{patch} images to {tuple(feat[-2:])} "
                              f"features: not a whole stride")
        trunk_stride = patch // side
        step = 1 if output_stride is None else output_stride // trunk_stride
        if output_stride is not None and (output_stride % trunk_stride or step < 1):
            raise ConfigError("--output-stride", f"must be a multiple of the trunk's stride {trunk_stride}, "
                              f"got {output_stride}")
        last = layers[-1]
        if isinstance(last, ClassifierHead):
            modules, classes = [*layers[:-1], *head_as_convolution(last, side, step)], last.fc.out_features
        else:
            assert head is not None, "a classifier ends in a ClassifierHead or a pooled head"
            modules = [*layers[:-1], *head_on_cells(head, side, step)]
            classes = int(meta_output_shape(nn.Sequential(*layers), channels, (patch, patch), dtype)[1])
        min_side = patch
        pool = WindowPool(next(i for i, m in enumerate(modules) if isinstance(m, (nn.AvgPool2d, nn.MaxPool2d))
                               and i >= len(layers) - 1), side, step)
    else:
        modules = layers
        out = meta_output_shape(nn.Sequential(*layers), channels, (256,) * dims, dtype)
        if len(out) != 2 + dims:
            raise ConfigError("--checkpoint", f"the network's output has shape {tuple(out)}: it pools the "
                              f"whole image but its last layer is not a ClassifierHead (global pool + "
                              f"linear) or a cut model's pooled head, so it cannot be made fully convolutional")
        if output_stride is not None:
            raise ConfigError("--output-stride", "applies to classifiers only; a dense model's stride is its own")
        min_side, classes, pool = 1, int(out[1]), None
    net = FullyConvolutional(*modules, nn.Softmax(dim=1)).eval()
    net.shape = network_shape(net, channels, min_side, classes, dtype, dims)
    net.pool = pool
    return net


def network_shape(net: nn.Module, channels: int, min_side: int, classes: int, dtype: torch.dtype,
                  dims: int = 2) -> NetworkShape:
    """Output stride and alignment of ``net`` (sizes on the meta device) on ``dims`` spatial axes."""
    align = math.lcm(*(_strides(net, channels, dtype, dims) or [1]))
    side = max(min_side, align) * 4
    grow = align * 64
    thin = (max(min_side, align),) * (dims - 1)
    cells = [int(meta_output_shape(net, channels, (*thin, width), dtype)[-1]) for width in (side, side + grow)]
    if cells[1] <= cells[0] or grow % (cells[1] - cells[0]):
        raise ConfigError("--checkpoint", f"the network's output does not grow by a whole number of cells "
                          f"per input pixel ({cells[0]} -> {cells[1]} cells for {side} -> {side + grow} px)")
    return NetworkShape(stride=grow // (cells[1] - cells[0]), align=align, min_side=max(min_side, align),
                        classes=classes, dims=dims)


# --------------------------------------------------------------------- field probe
def _contaminated(net: nn.Module, images: torch.Tensor, axis: int) -> torch.Tensor:
    """Per probe image, which output cells along ``axis`` (-1 columns, -2 rows, -3 a volume's depth) hold a NaN."""
    rows = []
    with torch.no_grad():
        for chunk in images.split(PROBE_CHUNK):
            out = net(chunk)
            rows.append(torch.isnan(out).movedim(axis, -1).flatten(1, -2).any(dim=1))
    return torch.cat(rows)


def _last_true(low: int, high: int, holds: Callable[[int], bool]) -> int:
    """The largest ``r`` in ``[low, high]`` with ``holds(r)``, ``holds`` true up to some point (``holds(low)``)."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if holds(middle) else (low, middle - 1)
    return low


def _probe_axis(net: nn.Module, shape: NetworkShape, channels: int, axis: int, dtype: torch.dtype,
                device: torch.device) -> AxisField:
    """The field along ``axis`` from NaN edges at ``boundary + r`` (``r`` below the stride): how far the first
    clean cell after a NaN part and the last clean cell before one lie. Both move monotonically with ``r``,
    so the shifts where they move are found by bisection: about ``2 log2(stride) + 4`` probe images."""
    s, unit = shape.stride, math.lcm(shape.stride, shape.align)
    thickness = shape.min_side
    length = round_up_to(4 * max(shape.min_side, 64), unit)

    def bad_cells(r: int, nan_before: bool) -> torch.Tensor:
        image = torch.zeros(1, channels, *(thickness,) * (shape.dims - 1), length, dtype=dtype, device=device)
        if nan_before:
            image[..., :boundary + r] = float("nan")
        else:
            image[..., boundary + r:] = float("nan")
        return _contaminated(net, image.transpose(-1, axis) if axis != -1 else image, axis)[0]

    def first_clean(r: int) -> int:          # the first cell that sees no NaN before boundary + r
        clean = ~bad_cells(r, True)
        return int(clean.nonzero()[0]) if clean.any() else len(clean)

    def clean_count(r: int) -> int:          # cells before the first that sees NaN from boundary + r on
        bad = bad_cells(r, False)
        return int(bad.nonzero()[0]) if bad.any() else len(bad)

    while True:
        boundary = round_up_to(length // 2, unit)
        cells = len(bad_cells(0, True))
        ends = (first_clean(0), first_clean(s - 1), clean_count(0), clean_count(s - 1))
        if all(0 < end < cells - 1 for end in ends):
            break
        if length * thickness * 2 > PROBE_MAX_PIXELS * 1024:
            raise ConfigError("--checkpoint", "the network's receptive field is larger than a "
                              f"{length}-pixel probe; it cannot be streamed in windows")
        length *= 2
    b_cells = boundary // s
    first, last = ends[0], ends[3]
    lead = first - b_cells                                  # ceil(before / s)
    extra = _last_true(0, s - 1, lambda r: first_clean(r) == first)
    before = lead * s - extra
    a = b_cells + 1 - last
    rem = 0 if ends[2] == last else _last_true(0, s - 1, lambda r: clean_count(r) < last) + 1
    after = a * s + rem
    return AxisField(stride=s, before=before, after=after, align=shape.align)


def round_up_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def measure_fields(net: FullyConvolutional, channels: int = 1, device: torch.device | None = None
                   ) -> tuple[AxisField, ...]:
    """The field of one output cell along every spatial axis of a dense network (a volume's depth, rows, columns)."""
    device = device or torch.device("cpu")
    if net.pool is not None:
        return measure_field(net, channels, device)
    probe = copy.deepcopy(net).to(device=device, dtype=torch.float32).eval()
    return tuple(_probe_axis(probe, net.shape, channels, axis, torch.float32, device)
                 for axis in range(-net.shape.dims, 0))


def measure_field(net: FullyConvolutional, channels: int = 3, device: torch.device | None = None
                  ) -> tuple[AxisField, AxisField]:
    """The field of one output cell along rows and columns (NaN probes on ``device``, float32).

    A classifier's field is its trunk's (probed on images a trunk cell wide, not a training patch) widened by
    the window pool: cell ``j`` pools trunk cells ``j*step .. j*step+window-1``.
    """
    device = device or torch.device("cpu")
    probe = copy.deepcopy(net).to(device=device, dtype=torch.float32).eval()
    if net.pool is None:
        return (_probe_axis(probe, net.shape, channels, -2, torch.float32, device),
                _probe_axis(probe, net.shape, channels, -1, torch.float32, device))
    trunk = nn.Sequential(*list(probe)[:net.pool.index])
    shape = network_shape(trunk, channels, 1, net.shape.classes, torch.float32)
    rows, cols = (pooled_field(_probe_axis(trunk, shape, channels, axis, torch.float32, device), net.pool,
                               net.shape.align) for axis in (-2, -1))
    return rows, cols


def pooled_field(cell: AxisField, pool: WindowPool, align: int) -> AxisField:
    """The field of a window-pool cell over trunk cells of field ``cell`` (``align``: the whole network's)."""
    return AxisField(stride=cell.stride * pool.step, before=cell.before,
                     after=(pool.window - 1) * cell.stride + cell.after, align=align)


def classifies(layers: Sequence[nn.Module]) -> bool:
    """Whether ``layers`` classify whole images (a ``ClassifierHead`` or a cut model's pooled head last)."""
    return bool(layers) and (isinstance(layers[-1], ClassifierHead) or pooled_head(layers) is not None)
