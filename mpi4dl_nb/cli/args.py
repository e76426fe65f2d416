"""MPI4DL-compatible command-line flags and their mapping onto ``ParallelConfig``."""
from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from ..config import (
    PRECISIONS,
    SCHEDULES,
    SLICE_METHODS,
    ConfigError,
    ParallelConfig,
    ScheduleKind,
    SliceMethod,
    as_checkpoint_setting,
    parse_balance,
)
from ..config import (
    parse_slice_method as config_parse_slice_method,
)
from ..data.apps import AppKind
from .image_size import image_size_arg

# flag -> ParallelConfig field, in the order MPI4DL documents them
PARALLEL_FLAGS: dict[str, str] = {
    "--split-size": "split_size",
    "--spatial-size": "spatial_size",
    "--num-spatial-parts": "num_spatial_parts",
    "--slice-method": "slice_method",
    "--parts": "parts",
    "--times": "times",
    "--local-DP": "local_dp",
    "--halo-D2": "halo_d2",
    "--fused-layers": "fused_layers",
    "--balance": "balance",
    "--data-parallel": "data_parallel",
    "--schedule": "schedule",
    "--virtual-stages": "virtual_stages",
    "--sync-batchnorm": "sync_batchnorm",
    "--no-check-ops": "check_ops",
    "--checkpoint-activations": "checkpoint_activations",
    "--precision": "precision",
    "--grad-bucket-mb": "grad_bucket_mb",
}


def parse_bucket_mb(text: str) -> float | None:
    """Parse ``--grad-bucket-mb``: a size in MB, or ``none`` (one all-reduce per stage after all backwards)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in MB (e.g. 25) or 'none'") from None


def balance_flag(text: str) -> tuple[int, ...] | None:
    """argparse's type for ``--balance``: config.parse_balance, a refusal printed as the flag's usage error."""
    try:
        return parse_balance(text, "--balance")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(err.detail) from None


def parse_app(text: str) -> AppKind:
    """Normalise ``--app``: medical/cifar/synthetic or MPI4DL's numbers 1/2/3."""
    try:
        return AppKind.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_slice_method(text: str) -> str:
    """``--slice-method``'s argparse type (``config.parse_slice_method``, its refusal as a usage error)."""
    try:
        return config_parse_slice_method(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(f"--slice-method {err.detail}") from None


def add_parallel_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add MPI4DL's parallelism flags (plus ``--data-parallel``) to ``parser``; returns it."""
    g = parser.add_argument_group("parallelism (MPI4DL flags)")
    g.add_argument("--split-size", dest="split_size", type=int, default=2,
                   help="number of model partitions (stages) for layer/pipeline parallelism")
    g.add_argument("--spatial-size", dest="spatial_size", type=int, default=1,
                   help="how many of the first stages use spatial parallelism (0: none)")
    g.add_argument("--num-spatial-parts", dest="num_spatial_parts", type=int, default=4,
                   help="number of image tiles (ranks) per spatial stage")
    g.add_argument("--slice-method", dest="slice_method", type=parse_slice_method,
                   default=SliceMethod.SQUARE.value,
                   help=f"tile layout: {', '.join(SLICE_METHODS)}, or DxRxC for a volume's depth x rows x "
                        f"cols tiles (e.g. 2x2x2, with --num-spatial-parts D*R*C)")
    g.add_argument("--parts", dest="parts", type=int, default=1,
                   help="number of micro-batches for pipeline parallelism")
    g.add_argument("--times", dest="times", type=int, default=0,
                   help="GEMS replica pairs (0: no GEMS; 1 behaves like MPI4DL's GEMS scripts)")
    g.add_argument("--local-DP", dest="local_dp", type=int, default=1,
                   help="data-parallel copies of each non-spatial stage")
    g.add_argument("--halo-D2", dest="halo_d2", action="store_true",
                   help="fused halo exchange (design 2): fewer, wider halo exchanges")
    g.add_argument("--fused-layers", dest="fused_layers", type=int, default=1,
                   help="with --halo-D2, number of blocks sharing one halo exchange")
    g.add_argument("--balance", dest="balance", type=balance_flag, default=None,
                   help="layers per stage, e.g. 3,4,5 (sum = number of layers); default automatic")
    g.add_argument("--data-parallel", dest="data_parallel", type=int, default=1,
                   help="number of full model replicas trained data-parallel")
    g.add_argument("--schedule", dest="schedule", choices=SCHEDULES, default=ScheduleKind.GPIPE.value,
                   help="pipeline schedule of the micro-batches (extension; MPI4DL uses gpipe; "
                        "interleaved: with --virtual-stages; zb1: zero bubble, each backward split into "
                        "input- and weight-gradient halves, --parts >= --split-size; zbv: zero bubble V, "
                        "2 chunks per rank, rank r holding stages r and split-size-1-r, --parts >= "
                        "split-size / 2)")
    g.add_argument("--virtual-stages", dest="virtual_stages", type=int, default=1,
                   help="with --schedule interleaved: chunks per rank; the --split-size stages lie on "
                        "split-size / virtual-stages ranks, stage s on rank s mod that (Megatron); "
                        "--schedule zbv sets 2")
    g.add_argument("--sync-batchnorm", dest="sync_batchnorm", action="store_true",
                   help="BatchNorm over the combined samples of the data-parallel copies of a "
                        "micro-batch (with --parts 1 and no GEMS: one full-batch serial run; GEMS "
                        "directions keep separate statistics)")
    g.add_argument("--no-check-ops", dest="check_ops", action="store_false",
                   help="skip the spatial op guard's per-op checks (once a model has passed them)")
    g.add_argument("--checkpoint-activations", dest="checkpoint_activations", nargs="?", const="every",
                   default=None, type=as_checkpoint_setting, metavar="every|blocks|N",
                   help="activation recomputation: keep only segment inputs, recompute on backward "
                        "(every: each layer; blocks: ~sqrt(layers) per segment; N layers per segment)")
    g.add_argument("--precision", dest="precision", choices=PRECISIONS, default="fp32",
                   help="compute precision: autocast to bf16 (CPU/GPU) or fp16 (GPU, gradient "
                        "scaler); master weights and normalisation statistics stay float32")
    g.add_argument("--grad-bucket-mb", dest="grad_bucket_mb", type=parse_bucket_mb, default=25.0,
                   metavar="MB|none",
                   help="gradient all-reduce overlapped with backward: buckets of about MB megabytes, each "
                        "summed over the stage's holders as soon as its gradients are complete (default 25, "
                        "DDP's; none: one all-reduce per stage after all backwards)")
    return parser


def add_workload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add MPI4DL's model/data flags (image size, batch, epochs, layers, filters, app, ...)."""
    g = parser.add_argument_group("model and data (MPI4DL flags)")
    g.add_argument("-v", "--verbose", action="store_true", help="print performance numbers and logs")
    g.add_argument("--image-size", dest="image_size", type=image_size_arg, default=32, metavar="N|D,H,W",
                   help="image side in pixels (square images), or a volume patch's depth,height,width in voxels "
                        "(--model unet3d)")
    g.add_argument("--batch-size", dest="batch_size", type=int, default=32, help="global batch size")
    g.add_argument("--num-epochs", dest="num_epochs", type=int, default=1, help="number of epochs")
    g.add_argument("--num-layers", dest="num_layers", type=int, default=None,
                   help="AmoebaNet: number of normal/reduction cells (default 18); "
                        "ResNet: depth (default 110; v1 6n+2, v2 9n+2)")
    g.add_argument("--num-filters", dest="num_filters", type=int, default=None,
                   help="AmoebaNet: filters (default 416); ResNet: base width (default 16)")
    g.add_argument("--num-classes", dest="num_classes", type=int, default=None,
                   help="number of classes (default: the data's: its class folders, CIFAR-10's 10; else 10); "
                        "refused when it disagrees with the data")
    g.add_argument("--app", dest="app", type=parse_app, default=AppKind.SYNTHETIC,
                   help="data: medical (1), cifar (2) or synthetic (3)")
    g.add_argument("--datapath", dest="datapath", default=None,
                   help="dataset path: tile folder / slide file(s) for medical, "
                        "CIFAR-10 binary batches for cifar (medical default: bundled IHC sample)")
    return parser


def add_mpi4dl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every MPI4DL benchmark flag: parallelism plus model/data."""
    add_parallel_args(parser)
    add_workload_args(parser)
    return parser


def config_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ParallelConfig`` keyword arguments carried by parsed ``args``."""
    given = vars(args)
    return {field: given[field] for field in PARALLEL_FLAGS.values() if field in given}


def config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """Build the ``ParallelConfig`` from parsed MPI4DL flags (not yet validated against a world)."""
    kwargs = config_kwargs_from_args(args)
    if kwargs.get("balance") is not None:
        kwargs["balance"] = tuple(kwargs["balance"])
    try:
        return ParallelConfig(**kwargs)
    except TypeError as err:  # unknown field: a programming error surfaced clearly
        raise ConfigError("command line", f"cannot build ParallelConfig from the flags: {err}") from err


def validate_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``ParallelConfig.validate`` available from parsed workload flags."""
    given = vars(args)
    return {name: given[name] for name in ("batch_size", "image_size") if given.get(name) is not None}


def parallel_flags(cfg: ParallelConfig) -> list[str]:
    """The parallelism flags that give ``cfg`` (those that differ from the defaults), inverse of
    ``config_from_args``; ConfigError for a tile grid no ``--slice-method`` makes."""
    parser = add_parallel_args(argparse.ArgumentParser())
    defaults = vars(parser.parse_args([]))
    actions = {option: action for action in parser._actions for option in action.option_strings}
    if cfg.grid is not None:
        method = next((m for m in SliceMethod if m.grid_shape(cfg.num_spatial_parts) == cfg.grid), None)
        if method is None:
            raise ConfigError("grid", f"a {cfg.grid[0]}x{cfg.grid[1]} tile grid has no --slice-method; set "
                                      f"ParallelConfig(grid=...) from Python")
        cfg = replace(cfg, grid=None, slice_method=method)
    out: list[str] = []
    for flag, name in PARALLEL_FLAGS.items():
        value, default = getattr(cfg, name), defaults[name]
        if name == "slice_method" and cfg.volume_grid is not None:   # --slice-method DxRxC
            value = "x".join(map(str, cfg.volume_grid))
        if isinstance(value, tuple):
            value = ",".join(map(str, value))
            default = None if default is None else ",".join(map(str, default))
        elif value is not None and not isinstance(value, (bool, int)):
            value = str(value)
        if value == default:
            continue
        out += [flag] if actions[flag].nargs == 0 else [flag, str(value)]
    return out
