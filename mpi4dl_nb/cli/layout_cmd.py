"""``python -m mpi4dl_nb layout``: the rank table of a configuration (a volume patch's tiles with ``--image-size
D,H,W``), and the world-size guard."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from ..comm.device import local_rank_from_env
from ..config import ConfigError, ParallelConfig
from ..data.options import IMAGE_SIZE, ImageSize, VolumeSize
from ..layout import layout, layout_table
from ..models.model_args import NO_ARGS, ModelArgs
from ..models.options import MODEL, MODEL_ARGS, NUM_CLASSES
from ..run import flag_groups as groups
from ..run.model_choice import ModelChoice, ModelSizes
from ..run.training_spec import OptimizerChoice
from ..schema import build_job, flag
from .flag_names import as_flags, names_as_flags
from .job_flags import add_job_flags, keyword_values
from .parser import CommandParser, DefaultsHelpFormatter

EXIT_CONFIG = 2


def launched_world() -> tuple[int, int, bool]:
    """(rank, world size, launched by an MPI launcher) of this process."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    return comm.Get_rank(), size, size > 1 or local_rank_from_env() is not None


def refuse(message: str, rank: int = 0, world_size: int = 1) -> NoReturn:
    """Exit with EXIT_CONFIG (no communication); rank 0 prints the error once.

    Every rank reaches the same verdict from the same flags, so one copy of the message is
    enough (the other ranks exit silently). A message of the library's layers names flags, not Python names.
    """
    if rank == 0:
        print(f"mpi4dl_nb: configuration error: {as_flags(message)}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG)


def check_world_size(cfg: ParallelConfig, world_size: int, rank: int = 0) -> None:
    """Exit every rank at once, naming the rank count needed, when the launch does not match.

    Each rank decides alone from the same numbers, so no rank waits for another.
    """
    if cfg.world_size != world_size:
        refuse(names_as_flags(cfg.world_size_message(world_size)), rank, world_size)


@dataclass(frozen=True)
class LayoutJob:
    """What ``layout`` is asked: a configuration and, with ``--model``, the model whose stage cut it shows."""

    config: ParallelConfig = field(default_factory=ParallelConfig)
    model: str | None = MODEL.field(None, group=groups.MODEL)
    model_args: ModelArgs = MODEL_ARGS.field(NO_ARGS, default_text="none", group=groups.MODEL)
    sizes: ModelSizes = field(default_factory=ModelSizes)
    num_classes: int = NUM_CLASSES.field(10, group=groups.MODEL)
    image_size: ImageSize = IMAGE_SIZE.field(32, group=groups.MODEL)
    json: bool = flag("--json", "print the layout as JSON", False, switch=True)
    optimizer: OptimizerChoice = field(default_factory=OptimizerChoice)   # with --model: the state table's slots
    cost: bool = flag("--cost", "with --model: also print the planner's cost of the configuration (peak memory per "
                                "rank, the spatial stage's attention exchanges per tile)", False, switch=True,
                      group=groups.MODEL)


def layout_parser() -> CommandParser:
    parser = CommandParser(prog="python -m mpi4dl_nb layout", formatter_class=DefaultsHelpFormatter,
                           description="Show which rank does what for a configuration, and how many ranks it needs.")
    return add_job_flags(parser, LayoutJob)


def model_cut(job: LayoutJob) -> str:
    """The stage table of the model ``job`` names, for its configuration at its image size (ConfigError for a model
    that does not resolve or a cut that does not fit)."""
    import torch

    from ..models.vit import refuse_token_spatial_stage
    from .stage_table import stage_table, state_table

    assert job.model is not None and isinstance(job.image_size, int), "an image model asked for"
    spec = ModelChoice(job.model, job.model_args, job.sizes, normalize="none").spec(job.num_classes)
    job.config.validate(image_size=job.image_size)
    try:
        torch.manual_seed(0)
        layers = spec.build(job.image_size)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError("--model", str(err)) from None
    refuse_token_spatial_stage(layers, job.config, job.image_size)
    table = stage_table(layers, job.config, job.image_size)
    table += "\n\n" + state_table(layers, job.config, job.image_size, job.optimizer.spec.state_slots)
    if not job.cost:
        return table
    from ..planner.exchanges import layout_cost

    return f"{table}\n{layout_cost(layers, job.config, job.image_size)}"


def print_layout(cfg: ParallelConfig, as_json: bool) -> None:
    """The rank table and world size (or the layout as JSON)."""
    if as_json:
        roles = [{"rank": r.rank, "replica": r.replica, "stage": r.stage, "spatial": r.spatial,
                  "tile": r.tile, "copy": r.local_dp_index,
                  "mirror_stage": None if r.mirror is None else r.mirror.stage}
                 for r in layout(cfg)]
        print(json.dumps({"world_size": cfg.world_size, "config": cfg.as_dict(), "ranks": roles}))
        return
    print(layout_table(cfg))
    print(f"world size: {cfg.world_size} ranks ({cfg.describe_world()})")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the rank layout (or JSON with ``--json``); under mpiexec, check the rank count."""
    args = layout_parser().parse_args(argv)
    rank, size, launched = launched_world()
    try:
        job = build_job(LayoutJob, keyword_values(args, LayoutJob), "layout")
    except ConfigError as err:
        refuse(str(err), rank, size)
    if launched:
        check_world_size(job.config, size, rank)
    if rank != 0:
        return 0
    print_layout(job.config, job.json)
    try:
        if isinstance(job.image_size, tuple):
            print(volume_tiles(job.config, job.image_size))
        if job.model is not None:
            if isinstance(job.image_size, tuple):
                refuse(f"--image-size: {','.join(map(str, job.image_size))} is a volume's patch; the stage cut "
                       f"(--model) is computed for images (--image-size N). train checks a volume's cut before its "
                       f"first step; drop --model to see the volume's tiles")
            print(f"\nstage cut of {job.model}:\n{model_cut(job)}")
    except ConfigError as err:
        refuse(str(err))
    return 0


def volume_tiles(cfg: ParallelConfig, size: VolumeSize) -> str:
    """``--image-size D,H,W``: the patch checked against the tile grid (ConfigError: an image grid, or a DxRxC grid
    it does not fit) and each tile's voxels; one line when nothing tiles it."""
    from ..spatial.geometry import TileGrid

    shown = "x".join(map(str, size))
    if cfg.spatial_size > 0 and cfg.volume_grid is None:
        raise ConfigError("--slice-method", f"{cfg.slice_method} tiles images; a volume's patch {shown} is tiled "
                                            f"depth x rows x cols: give --slice-method DxRxC")
    cfg.validate(image_size=size)
    if cfg.spatial_size == 0 or cfg.volume_grid is None:
        return f"volume patch {shown} (DxHxW): not tiled (--spatial-size 0)"
    extents = TileGrid.of_shape(cfg.volume_grid).extents(size)
    lines = [f"tiles of the {shown} (DxHxW) volume patch, in voxels [start, stop) per axis:"]
    lines += [f"  tile {t}: " + " x ".join(f"[{a}, {b})" for a, b in extent) for t, extent in enumerate(extents)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
