"""``python -m mpi4dl_nb infer``: a trained checkpoint over a whole slide (or a cohort) on spatial ranks; maps out."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError
from .args import parse_slice_method
from .checkpoint_flags import add_checkpoint_flags, chosen_checkpoint
from .device_flags import add_device_flags, check_device_flags
from .model_flags import model_arg
from .parser import CommandParser, DefaultsHelpFormatter
from .resolution_flags import add_resolution_flags

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from ..infer.cohort import CohortSummary
    from ..infer.slide_level import SlideLevelSettings

EXIT_SETUP = 2
EXIT_SLIDES_FAILED = 3
VOLUME_WINDOW = 64       # a volume's input voxels per rank and axis when --window is not given


def window_arg(text: str) -> int | tuple[int, ...]:
    """``--window N`` or a volume's ``D,H,W``."""
    try:
        sides = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window {text!r}: give N or D,H,W (whole numbers)") from None
    if len(sides) not in (1, 3):
        raise argparse.ArgumentTypeError(f"--window {text!r}: give N or D,H,W")
    return sides[0] if len(sides) == 1 else sides


# flags of slide inference alone (not for a --volume)
SLIDE_ONLY = ("memory_budget", "output_stride", "map_mode", "heat_class", "threshold", "min_area", "exclude_classes",
              "overlay_side", "tissue_only", "min_tissue", "batch_windows", "resume", "max_window_rows", "level",
              "mpp", "magnification", "source_mpp")


def build_parser() -> argparse.ArgumentParser:
    """The ``infer`` flags."""
    from ..data.task import Task
    from ..infer.outputs import HELP as OUTPUT_HELP
    from ..infer.settings import DEFAULT_BUDGET, DTYPES, OVERLAY_SIDE

    parser = CommandParser(
        prog="python -m mpi4dl_nb infer",
        description="Apply a checkpoint of 'train' fully convolutionally to a whole slide, window by window, "
                    "each window split over --num-spatial-parts ranks (mpiexec -n <parts>). The output equals "
                    "the same network run on the whole slide in one process. A checkpoint of 'train --whole-slide' "
                    "instead gives one prediction per slide from its canvas (--slides A,B or --cohort FILE.csv, "
                    "--output DIR: slides.csv, and for attention/max heads a slide-aligned OME-TIFF and GeoJSON "
                    "of where it looked). Exit status: 0 done, 2 refused "
                    "before any work, 3 some slides of --slides failed (named on stderr; the others are done).",
        formatter_class=DefaultsHelpFormatter)
    add_checkpoint_flags(parser)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--slide", help="anything OpenSlide opens, or a plain image")
    where.add_argument("--slides", help="many slides: a folder of slide files, a text file with one path per "
                                        "line, slide files separated by commas, or a cohort manifest FILE.csv (as "
                                        "--cohort); every --output then names one file per slide with {slide} "
                                        "(a whole-slide model: --output DIR)")
    where.add_argument("--volume", help="a volume (multi-page TIFF stack or NIfTI .nii/.nii.gz) for a 3-D network "
                                        "(--model unet3d): --output NAME.tif|.nii|.nii.gz is its label volume, "
                                        "NAME_prob<k> each class' probabilities (float32), with the input's voxel "
                                        "size; --slice-method DxRxC, --window N or D,H,W")
    where.add_argument("--cohort", dest="cohort_file", metavar="FILE.csv",
                       help="a cohort manifest (columns slide,label[,patient,...]; paths relative to the file): its "
                            "slides, each one's label and patient in the summary table")
    parser.add_argument("--summary", default=None,
                        help="with --slides: the summary table (CSV; default summary.csv beside the outputs)")
    parser.add_argument("--output", dest="outputs", action="append", required=True,
                        help=f"repeat for several; {OUTPUT_HELP}")
    res = parser.add_argument_group("resolution")
    add_resolution_flags(res, "default: the checkpoint's training MPP when it records one, else --slide-level")
    res.add_argument("--slide-level", dest="level", type=int, default=None,
                     help="pyramid level to read as it is (default 0; not with --mpp)")
    parser.add_argument("--num-spatial-parts", dest="num_spatial_parts", type=int, default=1,
                        help="ranks that share each window (= ranks to launch)")
    parser.add_argument("--slice-method", dest="slice_method", type=parse_slice_method, default="square",
                        help="how a window is cut among the ranks: square, vertical, horizontal; a volume's DxRxC "
                             "(default 1x1x1 for a volume)")
    parser.add_argument("--window", type=window_arg, default=None,
                        help="input pixels per rank and axis per pass (default: from --memory-budget); a volume: N "
                             f"or D,H,W voxels per rank (default {VOLUME_WINDOW})")
    parser.add_argument("--memory-budget", dest="memory_budget", type=int, default=DEFAULT_BUDGET,
                        help="bytes per rank one window may take when --window is not given")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype")
    parser.add_argument("--output-stride", dest="output_stride", type=int, default=None,
                        help="pixels per output cell of a classifier (a multiple of the trunk's stride; default: "
                             "the trunk's)")
    parser.add_argument("--task", choices=Task.values(), default=None,
                        help="refuse a checkpoint of the other task (default: run what the checkpoint holds)")
    parser.add_argument("--map-mode", dest="map_mode", choices=("dense", "tiles"), default="dense",
                        help="classifiers: dense computes every cell fully convolutionally (fast; a cell's features "
                             "see the slide around its tile); tiles applies the classifier to exactly the tile each "
                             "cell names, as trained (slower by about (patch / --output-stride)^2; use --output-stride "
                             "= the patch size for non-overlapping tiles)")
    parser.add_argument("--heat-class", dest="heat_class", type=int, default=None,
                        help="class drawn by the .png and .tif:preview of a classifier (default: the first positive "
                             "class after class 0, not background/normal/negative/'no ...'; printed)")
    parser.add_argument("--threshold", type=float, default=None,
                        help=".geojson: least probability of a region's class (default: 0.5 for a classifier, "
                             "the label map's most probable class for a segmentation network)")
    parser.add_argument("--min-area", dest="min_area", type=float, default=0.0,
                        help=".geojson: drop regions and holes smaller than this (level-0 pixels squared)")
    parser.add_argument("--exclude-class", dest="exclude_classes", action="append", default=[],
                        help=".geojson: a class not to trace (name or index; repeat for several), e.g. background")
    parser.add_argument("--overlay-side", dest="overlay_side", type=int, default=OVERLAY_SIDE,
                        help="largest side of the .png overlay (pixels)")
    parser.add_argument("--model", type=model_arg, default=None, metavar="MODEL",
                        help="refuse a checkpoint of another model (resnet, torchvision:resnet50, ...); the "
                             "checkpoint names the network it holds")
    parser.add_argument("--tissue-only", dest="tissue_only", action="store_true",
                        help="skip windows without tissue (judged on a low-resolution overview); their cells are NaN")
    parser.add_argument("--min-tissue", dest="min_tissue", type=float, default=0.0,
                        help="with --tissue-only: skip windows whose tissue share is at most this")
    parser.add_argument("--batch-windows", dest="batch_windows", type=int, default=1,
                        help="windows of equal size per forward")
    parser.add_argument("--resume", action="store_true",
                        help="continue a partial output from its last finished row; with --slides also skip the "
                             "slides whose outputs are all written")
    parser.add_argument("--max-window-rows", dest="max_window_rows", type=int, default=None,
                        help="stop after this many window rows (continue later with --resume)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.add_argument("--no-stain-normalize", dest="stain_normalize", action="store_false",
                        help="read the slide as stored, without the stain normalisation the checkpoint records")
    add_device_flags(parser)
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


# the flags of the window-by-window maps, which a whole-slide model (one prediction per canvas) does not take
WINDOW_ONLY = ("window", "memory_budget", "output_stride", "map_mode", "heat_class", "threshold", "min_area",
               "exclude_classes", "overlay_side", "tissue_only", "min_tissue", "batch_windows", "resume",
               "max_window_rows", "task", "model")


def whole_slide_checkpoint(checkpoint: str) -> bool:
    """Whether the checkpoint holds a ``train --whole-slide`` model (an unreadable one: no; the map path says why)."""
    from ..infer.whole_slide import is_whole_slide

    try:
        return is_whole_slide(checkpoint)
    except (OSError, ValueError, RuntimeError):
        return False


def slide_level_settings(args: dict[str, object], slides: str | None, summary: str | None) -> SlideLevelSettings:
    """The flags of slide-level inference (a whole-slide checkpoint), refusing those of window-by-window maps."""
    from ..infer.slide_level import SlideLevelSettings

    defaults = build_parser()
    given = [name for name in WINDOW_ONLY if args[name] != defaults.get_default(name)]
    if summary is not None:
        given.append("summary")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(flags.split(", ")[0], f"{flags}: not for a whole-slide model (one prediction per slide "
                                                f"from its canvas, as trained); drop {flags}")
    outputs = args["outputs"]
    assert isinstance(outputs, list)
    if len(outputs) != 1:
        raise ConfigError("--output", f"a whole-slide model writes one folder (slides.csv and a map per slide): give "
                                      f"--output DIR once, not {len(outputs)} times")
    source = slides if slides is not None else str(args["slide"])
    settings = SlideLevelSettings(
        checkpoint=str(args["checkpoint"]), slides=source, output=Path(outputs[0]).expanduser(),
        num_spatial_parts=int(str(args["num_spatial_parts"])), slice_method=str(args["slice_method"]),
        dtype=str(args["dtype"]), level=optional_int(args["level"]), mpp=optional_float(args["mpp"]),
        magnification=optional_float(args["magnification"]), source_mpp=optional_float(args["source_mpp"]),
        overwrite=bool(args["overwrite"]), stain_normalize=bool(args["stain_normalize"]))
    settings.check()
    return settings


def optional_int(value: object) -> int | None:
    return None if value is None else int(str(value))


def optional_float(value: object) -> float | None:
    return None if value is None else float(str(value))


def slide_level(settings: SlideLevelSettings, ctx: Comm, size: int) -> int:
    """Slide-level inference of a whole-slide model: the summary table and JSON line on stdout (rank 0)."""
    from ..infer.slide_level import run_slide_level

    return report_slides(lambda: run_slide_level(settings, ctx), ctx, size)


def report_slides(run: Callable[[], CohortSummary | None], ctx: Comm, size: int) -> int:
    """Run many slides; rank 0 prints the summary table and the JSON line; exit code 3 when some slides failed."""
    import json

    from ..comm.agreement import SetupFailed
    from ..infer.cohort import print_table

    try:
        summary = run()
    except (SetupFailed, ConfigError) as err:
        if ctx.rank == 0:
            say(0, size, f"error: {err}")
        return EXIT_SETUP
    if summary is None:
        return 0
    print_table(summary.results, sys.stdout)
    print(json.dumps(summary.as_dict()), flush=True)
    if summary.failed:
        say(0, size, f"{len(summary.failed)} of {len(summary.results)} slides failed: {', '.join(summary.failed)} "
            f"(named above; see {summary.table}); the others are done")
        return EXIT_SLIDES_FAILED
    return 0


def say(rank: int, world: int, text: str) -> None:
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    print(f"{prefix}mpi4dl_nb infer: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mpi4dl_nb infer``; the JSON summary is the last line on stdout (rank 0)."""

    from ..comm.agreement import SetupFailed
    from ..infer.cohort import run_cohort
    from ..infer.runner import SlideFailed, SlideRunner
    from ..infer.settings import InferSettings
    from .layout_cmd import launched_world

    parsed = build_parser().parse_args(argv)
    args = vars(parsed).copy()
    backend, device = args.pop("backend"), args.pop("device")
    cohort_file = args.pop("cohort_file")
    slides, summary_path = args.pop("slides") or cohort_file, args.pop("summary")
    args.pop("checkpoint_select")
    rank, size, _ = launched_world()
    volume = args.pop("volume")
    if volume is not None:
        return volume_main(parsed, args, volume, backend, device, (rank, size))
    try:
        check_device_flags(parsed)
        if not isinstance(args["window"], int | None):
            raise ConfigError("--window", "D,H,W is a volume's window (--volume); a slide's is one number")
        args["checkpoint"] = chosen_checkpoint(parsed)     # before the rank count: a missing checkpoint first
        level_settings = slide_level_settings(args, slides, summary_path) \
            if whole_slide_checkpoint(args["checkpoint"]) else None
        if level_settings is None and summary_path is not None and slides is None:
            raise ConfigError("--summary", "is for --slides (a cohort); drop it with --slide")
        settings = None if level_settings is not None else InferSettings(
            outputs=tuple(args.pop("outputs")), slide=args.pop("slide") or "",
            exclude_classes=tuple(args.pop("exclude_classes")), cohort=slides is not None, **args)
        if settings is not None:
            settings.check()
    except ConfigError as err:
        if rank == 0:
            say(0, size, f"configuration error: {err}")
        return EXIT_SETUP
    try:
        from ..comm.context import init

        ctx = init(backend=backend, device=device)
        if level_settings is not None:
            return slide_level(level_settings, ctx, size)
        assert settings is not None
        if slides is not None:
            return report_slides(lambda: run_cohort(settings, slides, ctx, summary=summary_path), ctx, size)
        try:
            runner = SlideRunner(settings, ctx)
        except (SetupFailed, ConfigError) as err:
            if ctx.rank == 0:
                say(0, size, f"error: {err}")
            return EXIT_SETUP
        try:
            summary = runner.run()
        except SlideFailed as err:
            if ctx.rank == 0:
                kept = "the rows done so far are kept: fix the slide and continue with --resume" if err.kept else \
                    "nothing was written: fix the slide and run again"
                say(0, size, f"error: {err}; {kept}")
            return EXIT_SETUP
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


def volume_settings(args: dict[str, object]) -> tuple[int | tuple[int, ...], str]:
    """``--window`` and ``--slice-method`` of a volume run, refusing the flags of slides."""
    defaults = build_parser()
    given = [name for name in SLIDE_ONLY if args.get(name) != defaults.get_default(name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(flags.split(", ")[0], f"{flags}: for slides, not a --volume; drop {flags}")
    outputs = args["outputs"]
    assert isinstance(outputs, list)
    if len(outputs) != 1:
        raise ConfigError("--output", "a volume gives one label volume (and its probability volumes beside it): "
                                      f"give --output NAME.tif|.nii|.nii.gz once, not {len(outputs)} times")
    method = str(args["slice_method"])
    if method == defaults.get_default("slice_method") and int(str(args["num_spatial_parts"])) == 1:
        method = "1x1x1"
    window = args["window"]
    return (VOLUME_WINDOW if window is None else window), method  # type: ignore[return-value]  # window_arg's type


def volume_main(parsed: argparse.Namespace, args: dict[str, object], volume: str, backend: str,
                device: str, world: tuple[int, int]) -> int:
    """``infer --volume``: the label and probability volumes; the JSON summary on stdout (rank 0)."""
    import json

    from ..comm.agreement import SetupFailed
    from ..infer.volume_api import infer_volume

    rank, size = world
    try:
        check_device_flags(parsed)
        window, method = volume_settings(args)
        checkpoint = chosen_checkpoint(parsed)
    except ConfigError as err:
        if rank == 0:
            say(0, size, f"configuration error: {err}")
        return EXIT_SETUP
    from ..comm.context import init

    ctx = init(backend=backend, device=device)
    outputs = args["outputs"]
    assert isinstance(outputs, list)
    try:
        summary = infer_volume(checkpoint, volume, outputs[0], ctx=ctx,
                               num_spatial_parts=int(str(args["num_spatial_parts"])), slice_method=method,
                               window=window, dtype=str(args["dtype"]), overwrite=bool(args["overwrite"]),
                               progress=bool(args["progress"]))
    except (SetupFailed, ConfigError) as err:
        if ctx.rank == 0:
            say(0, size, f"error: {err}")
        return EXIT_SETUP
    if summary is not None:
        print(json.dumps(summary), flush=True)
    return 0
