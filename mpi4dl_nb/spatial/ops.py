"""Which torch operations are exact on image tiles: the op guard's rules (pure: no MPI, no state).
More: docs/spatial.md#notes-by-module."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import SupportsIndex

import torch
import torch.nn.functional as F

IsTiled = Callable[[torch.Tensor], bool]
TorchOp = Callable[..., object]   # a torch function or Tensor method, as the op guard sees it
Args = Sequence[object]           # its positional arguments (tensors, numbers, sizes, lists of tensors)
Kwargs = Mapping[str, object]     # ... and keyword arguments


class OpKind(Enum):
    """How an operation relates to the spatial dimensions of a tile tensor."""

    METADATA = "metadata"        # reads sizes/flags: always fine
    POINTWISE = "pointwise"      # element-wise with broadcasting (replicated operands: size 1 spatially)
    DIMS = "dims"                # works along given dimensions: fine unless they are spatial
    SHAPE = "shape"              # view/reshape/expand/repeat: fine when the spatial sizes stay last
    INDEX = "index"              # x[...] / x[...] = v: fine unless the spatial dims are sliced
    CHANNEL = "channel"          # per-channel operand(s) (prelu, eval batch_norm)
    CONV = "conv"                # functional convolution: fine for 1x1, stride 1, no padding
    DROPOUT = "dropout"          # fine with p=0 or not training
    RESAMPLE = "resample"        # F.interpolate / upsample: computed exactly by the guard
    TRAILING = "trailing"        # acts along the last dims (F.linear, F.layer_norm): per pixel if no image dim is one
    RANDOM = "random"            # draws random numbers: refused on tiles; the tiles' random states must agree
    NORM = "norm"                # functional group/instance norm: statistics over the image by its handler
    ITERATE = "iterate"          # iterating over the batch dimension
    WINDOW = "window"            # functional pools etc.: use the module form
    POOLING = "pooling"          # pooling over the whole image (attention-MIL softmax_pool): computed by its handler
    REFUSED = "refused"          # known to mix pixels or be data/rank dependent


_POINTWISE = """
abs absolute acos acosh add addcdiv addcmul angle asin asinh atan atan2 atanh bfloat16
bitwise_and bitwise_not bitwise_or bitwise_xor cdouble ceil celu cfloat char clamp clamp_max
clamp_min clip clone contiguous copy_ copysign cos cosh cpu cuda deg2rad detach digamma div
divide double elu empty_like eq erf erfc erfinv exp exp2 expm1 fill_ fix float float_power floor
floor_divide fmax fmin fmod frac full_like ge gelu greater greater_equal gt half hardshrink
hardsigmoid hardswish hardtanh heaviside hypot i0 int isclose isfinite isinf isnan isneginf
isposinf le leaky_relu lerp less less_equal lgamma log log10 log1p log2 log_sigmoid logaddexp
logaddexp2 logical_and logical_not logical_or logical_xor logit logsigmoid long lt masked_fill
maximum minimum mish mul multiply mvlgamma nan_to_num ne neg negative new_empty new_full new_ones
new_tensor new_zeros nextafter not_equal ones_like pin_memory polygamma positive pow rad2deg
reciprocal relu relu6 remainder requires_grad_ round rsqrt rsub selu sgn short sigmoid
sign signbit silu sin sinc sinh softplus softshrink softsign sqrt square sub subtract tan tanh
tanhshrink threshold to true_divide trunc type_as where xlogy zero_ zeros_like
__abs__ __add__ __and__ __div__ __eq__ __floordiv__ __ge__ __gt__ __iadd__ __iand__ __idiv__
__ifloordiv__ __imod__ __imul__ __invert__ __ior__ __ipow__ __isub__ __itruediv__ __ixor__
__le__ __lt__ __mod__ __mul__ __ne__ __neg__ __or__ __pos__ __pow__ __radd__ __rand__ __rdiv__
__rfloordiv__ __rmod__ __rmul__ __ror__ __rpow__ __rsub__ __rtruediv__ __rxor__ __sub__
__truediv__ __xor__
""".split()

_METADATA = """
__format__ __hash__ __len__ __repr__ __set__ __setstate__ data_ptr dim element_size get_device
has_names is_complex is_contiguous is_floating_point is_inference is_pinned is_shared is_signed
ndimension nelement numel register_hook retain_grad size storage_offset stride type untyped_storage
""".split()

_WINDOW = """
adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d
adaptive_max_pool3d avg_pool1d avg_pool2d avg_pool3d conv_transpose1d conv_transpose2d
conv_transpose3d fractional_max_pool2d fractional_max_pool3d lp_pool1d lp_pool2d lp_pool3d
max_pool1d max_pool1d_with_indices max_pool2d max_pool2d_with_indices max_pool3d
max_pool3d_with_indices max_unpool1d max_unpool2d max_unpool3d
""".split()

_REFUSED_HINTS = {
    "pad": "pads each tile instead of the image; put the padding into the Conv2d/pool "
           "(padding=...) or move it after the spatial stage",
    "local_response_norm": "normalises over a window of each tile",
    "pixel_shuffle": "moves channels into the spatial dimensions of each tile",
    "pixel_unshuffle": "moves the spatial dimensions of each tile into channels",
    "unfold": "extracts windows from each tile without halos",
    "fold": "sums windows into each tile without halos",
    "grid_sample": "samples each tile at image coordinates it may not hold",
    "affine_grid": "builds image coordinates for one tile",
    "item": "reads a value of one tile into Python (differs per rank)",
    "tolist": "reads one tile's values into Python (differs per rank)",
    "numpy": "reads one tile's values (differs per rank)",
    "__bool__": "branches on one tile's values (differs per rank)",
    "__float__": "reads a value of one tile into Python (differs per rank)",
    "__int__": "reads a value of one tile into Python (differs per rank)",
    "__index__": "reads a value of one tile into Python (differs per rank)",
    "nonzero": "the result depends on one tile's values",
    "unique": "the result depends on one tile's values",
    "T": "transposes the spatial dimensions", "mT": "transposes the spatial dimensions",
    "H": "transposes the spatial dimensions", "mH": "transposes the spatial dimensions",
}

# ops along the trailing dims, refused when an image dim is among them
_TRAILING_HINTS = {
    "layer_norm": "normalises over the image rows or columns of each tile; use GroupNorm or "
                  "BatchNorm2d (whose statistics span every tile), normalise over channels only "
                  "(permute to channels-last first, as ConvNeXt does) or move it after the spatial stage",
    "rms_norm": "normalises over the image rows or columns of each tile; normalise over channels "
                "only (permute to channels-last first) or move it after the spatial stage",
    "linear": "acts on the last (width) dimension of a tile; flatten after a global pool, permute "
              "the channels last first, or move it after the spatial stage",
}

# functional norms computed on tiles by their handler (norm_calls.py); what it does not take is refused
_NORM_HINTS = {
    "group_norm": "needs an (N, C, H, W) tile in the plain layout; use the nn.GroupNorm module",
    "instance_norm": "needs an (N, C, H, W) tile in the plain layout; use the nn.InstanceNorm2d module",
}

_RANDOM = """
bernoulli bernoulli_ rand rand_like randn randn_like randint randint_like normal normal_ uniform_
exponential_ geometric_ cauchy_ log_normal_ random_ multinomial randperm poisson rrelu rrelu_
""".split()

# name -> (position, keyword, default) of the dimension argument; ALL: default reduces every dim
ALL = "all"
REQUIRED = "required"
_DIM_ARGS: dict[str, tuple[int, str, int | str]] = {}
for _names, _spec in (
        ("sum nansum mean nanmean prod amax amin argmax argmin std var std_mean var_mean all any "
         "count_nonzero max min aminmax", (1, "dim", ALL)),
        ("logsumexp cumsum cumprod cummax cummin logcumsumexp narrow select index_select unflatten",
         (1, "dim", REQUIRED)),
        ("softmax log_softmax softmin", (1, "dim", 1)),
        ("glu", (1, "dim", -1)),
        ("normalize cosine_similarity", (2, "dim", 1)),
        ("norm", (2, "dim", ALL)),
        ("chunk split tensor_split", (2, "dim", 0)),
        ("unbind", (1, "dim", 0)),
        ("repeat_interleave", (2, "dim", ALL)),
        ("flip", (1, "dims", REQUIRED)),
        ("roll", (2, "dims", ALL)),
        ("squeeze", (1, "dim", ALL)),
        ("cat concat concatenate", (1, "dim", 0)),
        ("stack unsqueeze", (1, "dim", REQUIRED)),
        ("transpose swapaxes swapdims", (1, "dim0", REQUIRED)),
        ("movedim moveaxis", (1, "source", REQUIRED)),
        ("permute", (1, "dims", REQUIRED)),
        ("flatten", (1, "start_dim", 0))):
    for _name in _names.split():
        _DIM_ARGS[_name] = _spec
_DIM_ARGS["stack"] = (1, "dim", 0)
_INSERTING = {"stack", "unsqueeze"}        # the dim names a position in the (one longer) output

_SHAPE = {"view", "reshape", "view_as", "reshape_as", "expand", "expand_as", "broadcast_to",
          "repeat", "tile", "expand_copy"}
_CHANNEL = {"prelu", "batch_norm", "channel_shuffle", "native_channel_shuffle"}
_CONV = {"conv2d", "conv1d", "conv3d", "convolution"}
_DROPOUT = {"dropout", "dropout2d", "dropout1d", "dropout3d", "alpha_dropout",
            "feature_alpha_dropout", "feature_dropout"}
_RESAMPLE = {"interpolate", "upsample", "upsample_nearest", "upsample_bilinear"}

_KINDS: dict[str, OpKind] = {}
for _kind, _group in ((OpKind.POINTWISE, _POINTWISE), (OpKind.METADATA, _METADATA),
                      (OpKind.WINDOW, _WINDOW), (OpKind.REFUSED, list(_REFUSED_HINTS)),
                      (OpKind.DIMS, list(_DIM_ARGS)), (OpKind.SHAPE, _SHAPE),
                      (OpKind.CHANNEL, _CHANNEL), (OpKind.CONV, _CONV), (OpKind.DROPOUT, _DROPOUT),
                      (OpKind.RESAMPLE, _RESAMPLE), (OpKind.TRAILING, list(_TRAILING_HINTS)),
                      (OpKind.RANDOM, _RANDOM), (OpKind.NORM, list(_NORM_HINTS))):
    for _name in _group:
        _KINDS[_name] = _kind
_KINDS["__getitem__"] = _KINDS["__setitem__"] = OpKind.INDEX
_KINDS["__iter__"] = OpKind.ITERATE
for _name in list(_POINTWISE):   # in-place variants: relu_, add_, ...
    if not _name.startswith("__") and not _name.endswith("_"):
        _KINDS.setdefault(_name + "_", OpKind.POINTWISE)

_GETTERS_REFUSED = {"T", "mT", "H", "mH"}

_registered: dict[TorchOp, OpKind] = {}


def register_op(func: TorchOp, kind: OpKind = OpKind.POINTWISE) -> None:
    """Declare a torch function exact on tiles as ``kind`` (e.g. a point-wise op the table lacks)."""
    _registered[func] = kind


def unregister_op(func: TorchOp) -> None:
    """Undo ``register_op``."""
    _registered.pop(func, None)


def op_name(func: TorchOp) -> str:
    """The name rules are keyed by: a property's name for getters, else the function's name."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name) if name == "__get__" else "__set__"
    return name


def display_name(func: TorchOp) -> str:
    """``F.max_pool2d``, ``Tensor.__getitem__``, ``torch.flip``, ``mil_pool.softmax_pool`` (this package's own ops):
    how the error names the op."""
    name = op_name(func)
    module = getattr(func, "__module__", "") or ""
    if module.startswith("mpi4dl_nb."):
        return f"{module.rsplit('.', 1)[-1]}.{name}"
    qualname = getattr(func, "__qualname__", name) or name
    if getattr(func, "__name__", "") == "__get__":
        return f"Tensor.{name}"
    if module.startswith("torch.nn.functional") or module == "torch._C._nn":
        return f"F.{name}"
    if "Tensor" in qualname or module in ("torch._tensor", "torch._C") and "." in qualname:
        return f"Tensor.{name}"
    return f"torch.{name}"


def kind_of(func: TorchOp) -> OpKind | None:
    """The OpKind of ``func`` (registered first), or None for an unknown operation."""
    kind = _registered.get(func)
    if kind is not None:
        return kind
    name = op_name(func)
    if getattr(func, "__name__", "") == "__get__":
        return OpKind.REFUSED if name in _GETTERS_REFUSED else OpKind.METADATA
    return _KINDS.get(name)


def refusal_hint(func: TorchOp) -> str:
    name = op_name(func)
    return (_REFUSED_HINTS.get(name) or _TRAILING_HINTS.get(name) or _NORM_HINTS.get(name)
            or "mixes pixels of a tile")


# ---------------------------------------------------------------------- argument helpers
def argument(args: Args, kwargs: Kwargs, position: int, keyword: str, default: object = None) -> object:
    if keyword in kwargs:
        return kwargs[keyword]
    return args[position] if len(args) > position else default


def _dim(value: object) -> int:
    """A dimension argument as an int (TypeError, as ``operator.index`` raises, for anything else)."""
    if not isinstance(value, SupportsIndex):
        raise TypeError(f"{type(value).__name__!r} object cannot be interpreted as a dimension")
    return operator.index(value)


def _as_dims(value: object) -> list[int]:
    if isinstance(value, (list, tuple, torch.Size)):
        return [_dim(v) for v in value]
    return [_dim(value)]


def _spatial_dims(ndim: int, axes: int = 2) -> set[int]:
    """The tiled dims of an ``ndim``-d tile whose last ``axes`` dims are tiled (3 on a volume's grid)."""
    return set(range(ndim - axes, ndim))


def _normalized(dims: Sequence[int], ndim: int) -> list[int]:
    return [d + ndim if d < 0 else d for d in dims]


def first_tiled(args: Args, is_tiled: IsTiled) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor) and is_tiled(a):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor) and is_tiled(b):
                    return b
    return None


def tensors_in(args: Args, kwargs: Kwargs) -> list[torch.Tensor]:
    """Tensors among the arguments (one level into lists/tuples)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found


# -------------------------------------------------------------------------- the checks
def check_pointwise(operands: Sequence[torch.Tensor], is_tiled: IsTiled,
                    offsets: Sequence[int] = (-2, -1)) -> str | None:
    """Replicated operands must be size 1 along the image dims (``offsets``, from the end); tiles must
    not be broadcast against each other."""
    tiles = [t for t in operands if is_tiled(t)]
    if not tiles:
        return None
    reach = -min(offsets)

    def image_sizes(t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.shape[o] for o in offsets)

    spatial = image_sizes(tiles[0]) if tiles[0].dim() >= reach else ()
    for t in tiles:
        if t.dim() < reach or image_sizes(t) != spatial:
            shown = image_sizes(t) if t.dim() >= reach else tuple(t.shape)
            return (f"broadcasts tile tensors of spatial sizes {spatial} and {shown} against each other")
    for t in operands:
        if is_tiled(t):
            continue
        if any(t.shape[o] != 1 for o in offsets if t.dim() >= -o):
            return (f"combines a tile with a replicated tensor of shape {tuple(t.shape)} that "
                    f"varies along the spatial dimensions (it is not split like the image); "
                    f"give it size 1 there (broadcast) or compute it from the tile")
    return None


def is_binary_extremum(name: str, args: Args, kwargs: Kwargs) -> bool:
    """``torch.max(a, b)`` / ``torch.min(a, b)``: point-wise, unlike ``x.max(dim)``."""
    return name in ("max", "min") and (len(args) > 1 and isinstance(args[1], torch.Tensor)
                                       or "other" in kwargs)


def check_dims(name: str, args: Args, kwargs: Kwargs, tile: torch.Tensor, axes: int = 2) -> str | None:
    """Dimension-wise ops: refuse when the dims include a spatial one (or default to all); ``axes``: how
    many trailing dims of the tile are spatial (3 on a volume's grid)."""
    position, keyword, default = _DIM_ARGS[name]
    ndim = tile.dim()
    if name == "permute":
        dims = _as_dims(args[1] if len(args) == 2 else args[1:]) if len(args) > 1 \
            else _as_dims(kwargs["dims"])
        order = _normalized(dims, ndim)
        return None if order[-axes:] == list(range(ndim - axes, ndim)) else "moves the spatial dimensions"
    if name in ("transpose", "swapaxes", "swapdims", "movedim", "moveaxis"):
        first = argument(args, kwargs, 1, keyword)
        second = argument(args, kwargs, 2, "dim1" if keyword == "dim0" else "destination")
        touched = set(_normalized(_as_dims(first) + _as_dims(second), ndim))
        return "moves the spatial dimensions" if touched & _spatial_dims(ndim, axes) else None
    if name == "flatten":
        end = _normalized([_dim(argument(args, kwargs, 2, "end_dim", -1))], ndim)[0]
        return "flattens the spatial dimensions" if end >= ndim - axes else None
    value = argument(args, kwargs, position, keyword, default)
    if value is None:    # explicit None: every dim (sum), or the implicit channel dim (softmax)
        value = default if isinstance(default, int) else ALL
    if name in ("cat", "concat", "concatenate", "stack"):
        joined = args[0] if args else ()
        tiles = [t for t in joined if isinstance(t, torch.Tensor)] if isinstance(joined, (list, tuple)) else []
        error = check_pointwise_shapes_for_cat(tiles, tile, name, axes)
        if error:
            return error
    if value is ALL:
        if name == "squeeze":
            return "squeeze() without a dim may drop a spatial dimension of size 1 on some tiles; give the dim"
        return "reduces over every dimension, the spatial ones included"
    if value is REQUIRED:
        return None
    dims = _as_dims(value)
    if name in _INSERTING:
        dims = _normalized(dims, ndim + 1)
        return None if all(d <= ndim - axes for d in dims) else "inserts a dimension after the spatial ones"
    return ("works along a spatial dimension" if set(_normalized(dims, ndim)) & _spatial_dims(ndim, axes)
            else None)


def _other_spatial_size(tile: torch.Tensor, tensors: Sequence[torch.Tensor], axes: int = 2) -> torch.Tensor | None:
    """The first of ``tensors`` whose last ``axes`` sizes differ from ``tile``'s, if any."""
    spatial = tuple(tile.shape[-axes:])
    return next((t for t in tensors if tuple(t.shape[-axes:]) != spatial), None)


def check_pointwise_shapes_for_cat(tensors: Sequence[torch.Tensor], tile: torch.Tensor,
                                   name: str, axes: int = 2) -> str | None:
    other = _other_spatial_size(tile, tensors, axes)
    if other is None:
        return None
    return (f"{name} joins a tile with a tensor of spatial size {tuple(other.shape[-axes:])}; "
            f"every input must be a tile of the same image size")


def check_index(tile: torch.Tensor, index: object) -> str | None:
    """``tile[index]``: items reaching the two spatial dims must be full slices ``:``, and no
    new dimension may appear between or after them."""
    items = index if isinstance(index, tuple) else (index,)
    ndim = tile.dim()
    spatial_from = ndim - 2

    def width(item: object) -> int:
        if item is None or item is Ellipsis:
            return 0
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            return item.dim()
        return 1

    def is_full(item: object) -> bool:
        return isinstance(item, slice) and item == slice(None, None, None)

    cut = next((i for i, item in enumerate(items) if item is Ellipsis), len(items))
    position = 0
    for item in items[:cut]:                       # left to right from dim 0
        if item is None:
            if position > spatial_from:
                return "inserts a dimension among the spatial ones"
            continue
        step = width(item)
        if position + step > spatial_from and not is_full(item):
            return "slices or indexes the spatial dimensions of a tile"
        position += step
    from_end = 0
    for item in reversed(items[cut + 1:]):         # right to left from the last dim
        if item is None:
            if from_end < 2:
                return "inserts a dimension among or after the spatial ones"
            continue
        step = width(item)
        if from_end < 2 and not is_full(item):
            return "slices or indexes the spatial dimensions of a tile"
        from_end += step
    return None


def check_conv(args: Args, kwargs: Kwargs) -> str | None:
    """A functional convolution is exact on tiles only as a 1x1, stride-1, unpadded one."""
    weight = argument(args, kwargs, 1, "weight")
    stride = argument(args, kwargs, 3, "stride", 1)
    padding = argument(args, kwargs, 4, "padding", 0)
    kernel = tuple(weight.shape[2:]) if isinstance(weight, torch.Tensor) else ()
    strides = _as_dims(stride) if not isinstance(stride, str) else [1]
    pads = [0] if padding in ("valid", "same") else (_as_dims(padding) if not isinstance(padding, str) else [1])
    if all(k == 1 for k in kernel) and all(s == 1 for s in strides) and all(p == 0 for p in pads):
        return None
    return (f"convolves (kernel {kernel}) one tile without the halo it needs; use an nn.Conv2d "
            f"module")


def check_dropout(func: TorchOp, args: Args, kwargs: Kwargs) -> str | None:
    p = argument(args, kwargs, 1, "p", 0.5)
    training = argument(args, kwargs, 2, "training" if "train" not in kwargs else "train", True)
    if p and training:
        return f"draws random masks per tile (p={p}), which differ from the serial model; use p=0"
    return None


def check_channel(func: TorchOp, args: Args, kwargs: Kwargs) -> str | None:
    if op_name(func) == "batch_norm":
        if func is not F.batch_norm:
            return "batch_norm called below the nn.functional level; use an nn.BatchNorm2d module"
        if argument(args, kwargs, 5, "training", False):
            return ("functional batch_norm in training mode computes statistics over one tile; "
                    "use an nn.BatchNorm2d module")
    return None


def check_shape(tile: torch.Tensor, outputs: Sequence[torch.Tensor], axes: int = 2) -> str | None:
    """After a view/reshape/expand/repeat: every output keeps the tile's spatial sizes (``axes``: 3 on a volume's
    tile) last."""
    other = _other_spatial_size(tile, outputs, axes)
    if other is None:
        return None
    return (f"reshapes a tile of spatial size {tuple(tile.shape[-axes:])} into {tuple(other.shape)}, "
            f"mixing the spatial dimensions")
