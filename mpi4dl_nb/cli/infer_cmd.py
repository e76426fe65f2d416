"""``python -m mpi4dl_nb infer``: a trained checkpoint over a whole slide on spatial ranks; heat map out."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from ..config import SLICE_METHODS, ConfigError
from ..models.spec import ModelFamily
from .device_flags import add_device_flags, check_device_flags

EXIT_SETUP = 2


def build_parser() -> argparse.ArgumentParser:
    """The ``infer`` flags."""
    from ..infer.runner import DEFAULT_BUDGET, DTYPES, OVERLAY_SIDE

    parser = argparse.ArgumentParser(
        prog="python -m mpi4dl_nb infer",
        description="Apply a checkpoint of 'train' fully convolutionally to a whole slide, window by window, "
                    "each window split over --num-spatial-parts ranks (mpiexec -n <parts>). The output equals "
                    "the same network run on the whole slide level in one process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint file, or a checkpoint directory (its newest)")
    parser.add_argument("--slide", required=True, help="anything OpenSlide opens, or a plain image")
    parser.add_argument("--slide-level", dest="level", type=int, default=0, help="pyramid level to read (0: full)")
    parser.add_argument("--output", dest="outputs", action="append", required=True,
                        help=".npy (probabilities, classes x H' x W'), .tif (pyramidal heat map), .png (overlay); "
                             "repeat for several")
    parser.add_argument("--num-spatial-parts", dest="num_spatial_parts", type=int, default=1,
                        help="ranks that share each window (= ranks to launch)")
    parser.add_argument("--slice-method", dest="slice_method", choices=SLICE_METHODS, default="square",
                        help="how a window is cut among the ranks")
    parser.add_argument("--window", type=int, default=None,
                        help="input pixels per rank and axis per pass (default: from --memory-budget)")
    parser.add_argument("--memory-budget", dest="memory_budget", type=int, default=DEFAULT_BUDGET,
                        help="bytes per rank one window may take when --window is not given")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype")
    parser.add_argument("--output-stride", dest="output_stride", type=int, default=None,
                        help="pixels per output cell (a multiple of the trunk's stride; default: the trunk's)")
    parser.add_argument("--heat-class", dest="heat_class", type=int, default=None,
                        help="class drawn in .tif/.png (default: the last)")
    parser.add_argument("--overlay-side", dest="overlay_side", type=int, default=OVERLAY_SIDE,
                        help="largest side of the .png overlay (pixels)")
    parser.add_argument("--model", choices=ModelFamily.values(), default=None,
                        help="refuse a checkpoint of another model family")
    parser.add_argument("--tissue-only", dest="tissue_only", action="store_true",
                        help="skip windows without tissue (judged on a low-resolution overview); their cells are NaN")
    parser.add_argument("--min-tissue", dest="min_tissue", type=float, default=0.0,
                        help="with --tissue-only: skip windows whose tissue share is at most this")
    parser.add_argument("--batch-windows", dest="batch_windows", type=int, default=1,
                        help="windows of equal size per forward")
    parser.add_argument("--resume", action="store_true", help="continue a partial output from its last finished row")
    parser.add_argument("--max-window-rows", dest="max_window_rows", type=int, default=None,
                        help="stop after this many window rows (continue later with --resume)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    add_device_flags(parser)
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def say(rank: int, world: int, text: str) -> None:
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    print(f"{prefix}mpi4dl_nb infer: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb infer``; the JSON summary is the last line on stdout (rank 0)."""
    from ..infer.runner import InferSettings, Runner, SetupFailed
    from .layout_cmd import launched_world

    parsed = build_parser().parse_args(argv)
    args = vars(parsed).copy()
    backend, device = args.pop("backend"), args.pop("device")
    rank, size, _ = launched_world()
    try:
        check_device_flags(parsed)
        settings = InferSettings(outputs=tuple(args.pop("outputs")), **args)
        settings.check()
    except ConfigError as err:
        if rank == 0:
            say(0, size, f"configuration error: {err}")
        return EXIT_SETUP
    try:
        from ..comm.context import init

        ctx = init(backend=backend, device=device)
        try:
            runner = Runner(settings, ctx)
        except (SetupFailed, ConfigError) as err:
            if ctx.rank == 0:
                say(0, size, f"error: {err}")
            return EXIT_SETUP
        summary = runner.run()
        if summary is not None:
            if not summary.complete:
                say(0, size, f"stopped after output row {summary.rows_done} of {summary.output_shape[1]}; "
                    f"continue with --resume")
            print(summary.to_json(), flush=True)
        return 0
    except SystemExit:
        raise
    except BaseException:
        sys.stderr.write(f"[rank {rank}/{size}] mpi4dl_nb infer failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if size > 1:
            from mpi4py import MPI

            from ..comm.context import abort_job

            abort_job(MPI.COMM_WORLD, 1)
        return 1
