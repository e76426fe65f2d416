"""The flags of ``train``: every MPI4DL benchmark flag plus model, data, run, checkpoint, training, task and held-out
flags, and their checks before any rank talks (which also resolve the classes from the data)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError
from ..data.apps import AppKind
from ..evaluation.metrics import MetricName
from ..models.spec import ModelFamily
from ..run.divergence import OnNonFinite
from ..run.identity import parse_allowed
from .args import add_mpi4dl_args
from .cohort_flags import add_cohort_args, check_cohort_args
from .device_flags import add_device_flags, check_device_flags
from .evaluation_flags import DTYPES, add_evaluation_args, check_evaluation_args, check_numbers
from .model_flags import VERSION_HELP, add_model_flag, add_pretrained_flags, check_model_flags
from .parser import CommandParser, DefaultsHelpFormatter
from .resolution_flags import add_resolution_flags, check_resolution_flags
from .segmentation_flags import add_task_args, check_task_args, check_task_classes
from .stain_flags import add_stain_args, check_stain_args
from .training_flags import add_training_args, check_keep_best, check_training_args
from .volume_flags import add_volume_args, check_volume_args
from .whole_slide_flags import add_whole_slide_args, check_whole_slide_args


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` parser: every MPI4DL benchmark flag plus model, checkpoint and run options."""
    parser = CommandParser(
        prog="python -m mpi4dl_nb train",
        description="Train ResNet, AmoebaNet-D or your own CNN (torchvision:, timm:, package.module:callable) "
                    "with hybrid spatial/layer/pipeline/GEMS/data "
                    "parallelism, exactly like one process. Launch with mpiexec -n <ranks>; "
                    "'python -m mpi4dl_nb layout <flags>' tells how many.",
        formatter_class=DefaultsHelpFormatter)
    add_model_flag(parser, ModelFamily.RESNET.value)
    add_pretrained_flags(parser)
    parser.add_argument("--resnet-version", dest="resnet_version", type=int, choices=(1, 2),
                        default=None, help=VERSION_HELP)
    add_mpi4dl_args(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=None,
                     help="total optimizer steps (default: num-epochs x batches per epoch)")
    run.add_argument("--seed", type=int, default=0, help="seed of weights and data order")
    run.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter/activation dtype")
    run.add_argument("--num-samples", dest="num_samples", type=int, default=256,
                     help="images in the synthetic dataset")
    run.add_argument("--slide-level", dest="slide_level", type=int, default=0,
                     help="--app medical with slides: pyramid level the tiles are cut from")
    add_resolution_flags(run, "--app medical; recorded in the checkpoint as infer's default")
    add_volume_args(run)
    run.add_argument("--min-tissue", dest="min_tissue", type=float, default=0.5,
                     help="--app medical with slides: least tissue fraction of a kept tile")
    add_device_flags(run)
    run.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar on rank 0")
    run.add_argument("--skip-bad-files", dest="skip_bad_files", action="store_true",
                     help="train on the usable files when the data check finds bad ones (default: refuse)")
    run.add_argument("--on-nonfinite", dest="on_nonfinite", choices=[p.value for p in OnNonFinite],
                     default=OnNonFinite.STOP.value,
                     help="a NaN/inf loss or gradient stops the run (exit 3), or skips that step")
    run.add_argument("--step-timeout", dest="step_timeout", type=float, default=None, metavar="SECONDS",
                     help="abort the job when a rank makes no progress for this long, naming it "
                          "(default: 10x the slowest of the first 3 steps, at least 60 s; 0: off)")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", dest="checkpoint_dir", default=None,
                      help="write atomic checkpoints step-NNNNNNNN-<run>.pt (+ .json manifest) here")
    ckpt.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=0,
                      help="checkpoint every N steps (0: at each epoch end and at the end)")
    ckpt.add_argument("--keep-checkpoints", dest="keep_checkpoints", type=int, default=2,
                      help="how many newest checkpoints of this run to keep")
    ckpt.add_argument("--keep-best", dest="keep_best", choices=MetricName.values(), default=None, metavar="METRIC",
                      help=f"also keep the checkpoint of the best evaluation by METRIC "
                           f"({', '.join(MetricName.values())}; lower val_loss, higher others is better) as "
                           f"best-step-*.pt, never rotated away")
    ckpt.add_argument("--resume", default=None,
                      help="continue from a checkpoint file, a directory, or 'latest' "
                           "(in --checkpoint-dir): the newest intact one of this configuration")
    ckpt.add_argument("--allow-config-change", dest="allow_config_change", action="append",
                      default=None, metavar="FIELDS",
                      help="resume although these fields changed (comma-separated: model, dtype, "
                           "image_size, batch_size, seed, app, data, lr, momentum, val_split, optimizer, "
                           "lr_schedule, augment, class_weights, classes, stain, or all)")
    add_training_args(parser)
    add_task_args(parser)
    add_evaluation_args(parser)
    add_cohort_args(parser)
    add_stain_args(parser)
    add_whole_slide_args(parser)
    return parser


def check_run_args(args: argparse.Namespace) -> None:
    """Errors in the non-parallel flags, naming the flag and what works (before any rank talks)."""
    check_numbers(args)
    check_task_args(args)
    check_volume_args(args)
    if args.datapath is not None and not AppKind.parse(args.app).reads_datapath:
        raise ConfigError("--datapath", f"--app {args.app} does not read --datapath (it would train on "
                          f"generated images); use --app medical for tiles/slides or --app cifar for "
                          f"CIFAR-10 batches, or drop --datapath")
    check_device_flags(args)
    check_model_flags(args)
    check_resolution_flags(args)
    if args.resume == "latest" and args.checkpoint_dir is None:
        raise ConfigError("--resume", "'latest' looks in --checkpoint-dir; give --checkpoint-dir "
                          "or a checkpoint path")
    if args.resume not in (None, "latest") and not Path(args.resume).expanduser().exists():
        raise ConfigError("--resume", f"{args.resume!r}: no such checkpoint file or directory")
    parse_allowed(args.allow_config_change)
    check_evaluation_args(args)
    check_whole_slide_args(args)
    check_cohort_args(args)
    check_stain_args(args)
    check_training_args(args)
    check_keep_best(args)
    check_task_classes(args)
