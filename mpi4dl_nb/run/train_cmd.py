"""``python -m mpi4dl_nb train``: MPI4DL-compatible batch training (any SP/LP/PP/GEMS/DP mix) with checkpoints."""
from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..comm.device import BACKENDS, DEVICES, cuda_unavailable_reason
from ..config import ConfigError, ParallelConfig
from .args import add_mpi4dl_args, config_from_args

if TYPE_CHECKING:
    from ..comm.protocol import Comm

EXIT_SETUP = 2
DTYPES = ("float32", "float64")


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` parser: every MPI4DL benchmark flag plus model, checkpoint and run options."""
    parser = argparse.ArgumentParser(
        prog="python -m mpi4dl_nb train",
        description="Train ResNet or AmoebaNet-D with hybrid spatial/layer/pipeline/GEMS/data "
                    "parallelism, exactly like one process. Launch with mpiexec -n <ranks>; "
                    "'python -m mpi4dl_nb layout <flags>' tells how many.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=("resnet", "amoebanet"), default="resnet",
                        help="network to train")
    parser.add_argument("--resnet-version", dest="resnet_version", type=int, choices=(1, 2),
                        default=2, help="ResNet v1 (basic blocks, depth 6n+2) or v2 (bottlenecks, 9n+2)")
    add_mpi4dl_args(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=None,
                     help="total optimizer steps (default: num-epochs x batches per epoch)")
    run.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    run.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    run.add_argument("--seed", type=int, default=0, help="seed of weights and data order")
    run.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter/activation dtype")
    run.add_argument("--num-samples", dest="num_samples", type=int, default=256,
                     help="images in the synthetic dataset")
    run.add_argument("--slide-level", dest="slide_level", type=int, default=0,
                     help="--app medical with slides: pyramid level the tiles are cut from")
    run.add_argument("--min-tissue", dest="min_tissue", type=float, default=0.5,
                     help="--app medical with slides: least tissue fraction of a kept tile")
    run.add_argument("--backend", choices=BACKENDS, default="auto",
                     help="tensor data plane: mpi (mpi4py; CUDA-aware MPI or staged on GPU), "
                          "gloo (torch.distributed, CPU), nccl (torch.distributed, CUDA); "
                          "auto: nccl on GPU, mpi on CPU")
    run.add_argument("--device", choices=DEVICES, default="auto",
                     help="where tensors live: cuda (refused at once, naming what is missing, "
                          "when no GPU can be used), cpu, or auto (cuda when visible)")
    run.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar on rank 0")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", dest="checkpoint_dir", default=None,
                      help="write atomic checkpoints step-NNNNNNNN.pt here")
    ckpt.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=0,
                      help="checkpoint every N steps (0: at each epoch end and at the end)")
    ckpt.add_argument("--keep-checkpoints", dest="keep_checkpoints", type=int, default=2,
                      help="how many newest checkpoints to keep")
    ckpt.add_argument("--resume", default=None,
                      help="continue from a checkpoint file, a directory, or 'latest' "
                           "(in --checkpoint-dir)")
    return parser


def run_info(args: argparse.Namespace) -> dict[str, Any]:
    """What identifies the run in checkpoints and the JSON summary."""
    from ..models import DEFAULT_NUM_FILTERS, DEFAULT_NUM_LAYERS

    return {"model": args.model,
            "resnet_version": args.resnet_version if args.model == "resnet" else None,
            "num_layers": args.num_layers if args.num_layers is not None
            else DEFAULT_NUM_LAYERS[args.model],
            "num_filters": args.num_filters if args.num_filters is not None
            else DEFAULT_NUM_FILTERS[args.model],
            "num_classes": args.num_classes, "image_size": args.image_size,
            "batch_size": args.batch_size, "app": args.app, "dtype": args.dtype}


def check_run_args(args: argparse.Namespace) -> None:
    """Errors in the non-parallel flags, naming the flag and what works."""
    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--image-size", args.image_size, 1),
                               ("--num-epochs", args.num_epochs, 1), ("--num-classes", args.num_classes, 1),
                               ("--num-samples", args.num_samples, 1),
                               ("--keep-checkpoints", args.keep_checkpoints, 1),
                               ("--checkpoint-every", args.checkpoint_every, 0)):
        if value < least:
            raise ConfigError(flag, f"must be >= {least}, got {value}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError("--steps", f"must be >= 1, got {args.steps}")
    if args.device == "cuda" or args.backend == "nccl":
        missing = cuda_unavailable_reason()
        if missing is not None:
            flag, value = ("--device", "cuda") if args.device == "cuda" else ("--backend", "nccl")
            raise ConfigError(flag, f"{value} needs a CUDA GPU: {missing}; use --device cpu (or "
                                    f"auto) with --backend mpi or gloo")
    if args.backend == "gloo" and args.device == "cuda":
        raise ConfigError("--backend", "gloo moves CPU tensors; with --device cuda use --backend "
                                       "nccl or mpi")
    if args.resume == "latest" and args.checkpoint_dir is None:
        raise ConfigError("--resume", "'latest' looks in --checkpoint-dir; give --checkpoint-dir "
                          "or a checkpoint path")


def say(rank: int, world: int, text: str) -> None:
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    print(f"{prefix}mpi4dl_nb train: {text}", file=sys.stderr, flush=True)


def agree_or_exit(ctx: Comm, error: BaseException | None) -> None:
    """All ranks learn whether any rank failed in set-up; then all exit together (code 2)."""
    messages = ctx.all_gather_object(None if error is None else f"{error}")
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    same_everywhere = len(failed) == len(messages) and len({m for _, m in failed}) == 1
    if same_everywhere:
        if ctx.rank == 0:
            say(0, ctx.world_size, f"error (on every rank): {error}")
    elif error is not None:
        say(ctx.rank, ctx.world_size, f"error: {error}")
    elif ctx.rank == 0:
        say(0, ctx.world_size, f"rank {failed[0][0]} failed during set-up: {failed[0][1]}")
    raise SystemExit(EXIT_SETUP)


class Setup:
    """Everything a run needs, built before any training collective."""

    def __init__(self, args: argparse.Namespace, cfg: ParallelConfig, ctx: Comm) -> None:
        import torch

        from ..data import Batcher, make_dataset
        from ..models import build_model
        from .train import check_spatial_geometry, load_for_resume

        self.args = args
        self.info = run_info(args)
        self.dtype = getattr(torch, args.dtype)
        torch.manual_seed(args.seed)
        self.layers = build_model(args.model, num_layers=args.num_layers,
                                  num_filters=args.num_filters, num_classes=args.num_classes,
                                  version=args.resnet_version, image_size=args.image_size)
        for layer in self.layers:
            layer.to(self.dtype)
        cfg.validate(batch_size=args.batch_size, num_layers=len(self.layers),
                     image_size=args.image_size)
        check_spatial_geometry(self.layers, cfg, args.image_size)
        dataset = make_dataset(args.app, args.image_size, args.num_classes, datapath=args.datapath,
                               seed=args.seed, num_samples=args.num_samples,
                               slide_level=args.slide_level, min_tissue=args.min_tissue)
        if dataset.num_classes > args.num_classes:
            raise ConfigError("--num-classes", f"the data has {dataset.num_classes} classes; use "
                              f"--num-classes {dataset.num_classes}")
        self.batcher = Batcher(dataset, args.batch_size, seed=args.seed)
        self.steps = args.steps if args.steps is not None else \
            args.num_epochs * self.batcher.steps_per_epoch
        self.checkpoint: dict[str, Any] | None = None
        self.resume_path: Path | None = None
        if args.resume is not None:
            from .checkpoint import resolve_resume

            self.resume_path = resolve_resume(args.resume, args.checkpoint_dir)
            if ctx.rank == 0:
                self.checkpoint = load_for_resume(self.resume_path, self.info)
                if self.checkpoint["step"] > self.steps:
                    raise ConfigError("--steps", f"the checkpoint is at step "
                                      f"{self.checkpoint['step']}, past --steps {self.steps}; "
                                      f"use --steps >= {self.checkpoint['step']}")


def train_main(args: argparse.Namespace, cfg: ParallelConfig) -> int:
    """Set up (every rank agrees on set-up errors), train, print the JSON summary on rank 0."""
    import torch
    from torch import nn

    import mpi4dl_nb as dl

    from .train import Trainer, TrainSettings, summary_line

    ctx = dl.init(backend=args.backend, device=args.device)
    setup = None
    try:
        setup = Setup(args, cfg, ctx)
        error = None
    except (ConfigError, ValueError, FileNotFoundError, KeyError, OSError) as err:
        error = err
    agree_or_exit(ctx, error)
    assert setup is not None
    engine = dl.HybridEngine(setup.layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda params: torch.optim.SGD(params, lr=args.lr,
                                                                       momentum=args.momentum))
    settings = TrainSettings(steps=setup.steps,
                             checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
                             checkpoint_every=args.checkpoint_every,
                             keep_checkpoints=args.keep_checkpoints, progress=args.progress,
                             verbose=args.verbose, dtype=setup.dtype)
    trainer = Trainer(engine, setup.batcher, ctx, settings, setup.info)
    if args.resume is not None:
        step = trainer.restore(setup.checkpoint)
        if ctx.rank == 0 and args.verbose:
            say(0, ctx.world_size, f"resumed from {setup.resume_path} at step {step}")
    summary = trainer.run()
    if summary is not None:
        summary["config"] = engine.cfg.as_dict()
        if args.verbose:
            print(verbose_report(summary), file=sys.stderr, flush=True)
        print(summary_line(summary), flush=True)
    return 0


def verbose_report(summary: dict[str, Any]) -> str:
    """Human-readable per-rank table for ``-v``."""
    rate = summary["images_per_s"]
    lines = [f"{summary['model']}: {summary['steps_run']} steps, "
             f"{'n/a' if rate is None else f'{rate:.3f}'} images/s, final loss {summary['loss']:.4f}",
             "rank  peak MB  activations MB  compute s  comm s"]
    for rank, (peak, act, comp, comm) in enumerate(zip(
            summary["peak_memory_bytes"], summary["activation_peak_bytes"],
            summary["compute_seconds"], summary["comm_seconds"])):
        lines.append(f"{rank:4d}  {peak / 2**20:7.1f}  {act / 2**20:14.1f}  {comp:9.2f}  {comm:6.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb train``."""
    from .layout_cmd import check_world_size, launched_world, refuse

    args = build_parser().parse_args(argv)
    rank, size, launched = launched_world()
    try:
        cfg = config_from_args(args)
        check_run_args(args)
    except ConfigError as err:
        refuse(str(err), rank, size)
    check_world_size(cfg, size, rank)
    try:
        return train_main(args, cfg)
    except SystemExit:
        raise
    except BaseException:
        sys.stderr.write(f"[rank {rank}/{size}] mpi4dl_nb train failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if size > 1:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        return 1
