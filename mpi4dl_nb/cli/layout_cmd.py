"""``python -m mpi4dl_nb layout``: the rank table of a configuration (a volume patch's tiles with ``--image-size
D,H,W``), and the world-size guard."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..comm.device import local_rank_from_env
from ..config import ConfigError, ParallelConfig
from ..layout import layout, layout_table
from .args import add_parallel_args, config_from_args
from .image_size import VolumeSize
from .model_flags import add_model_cut_args, model_cut
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
    enough (the other ranks exit silently).
    """
    if rank == 0:
        print(f"mpi4dl_nb: configuration error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG)


def check_world_size(cfg: ParallelConfig, world_size: int, rank: int = 0) -> None:
    """Exit every rank at once, naming the rank count needed, when the launch does not match.

    Each rank decides alone from the same numbers, so no rank waits for another.
    """
    if cfg.world_size != world_size:
        refuse(cfg.world_size_message(world_size), rank, world_size)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the rank layout (or JSON with ``--json``); under mpiexec, check the rank count."""
    parser = CommandParser(
        prog="python -m mpi4dl_nb layout", formatter_class=DefaultsHelpFormatter,
        description="Show which rank does what for a configuration, and how many ranks it needs.")
    add_parallel_args(parser)
    add_model_cut_args(parser)
    parser.add_argument("--json", action="store_true", help="print the layout as JSON")
    args = parser.parse_args(argv)
    rank, size, launched = launched_world()
    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        refuse(str(err), rank, size)
    if launched:
        check_world_size(cfg, size, rank)
    if rank != 0:
        return 0
    if args.json:
        roles = [{"rank": r.rank, "replica": r.replica, "stage": r.stage, "spatial": r.spatial,
                  "tile": r.tile, "copy": r.local_dp_index,
                  "mirror_stage": None if r.mirror is None else r.mirror.stage}
                 for r in layout(cfg)]
        print(json.dumps({"world_size": cfg.world_size, "config": cfg.as_dict(), "ranks": roles}))
    else:
        print(layout_table(cfg))
        print(f"world size: {cfg.world_size} ranks ({cfg.describe_world()})")
    if isinstance(args.image_size, tuple):
        try:
            print(volume_tiles(cfg, args.image_size))
        except ConfigError as err:
            refuse(str(err))
    if args.model is not None:
        if isinstance(args.image_size, tuple):
            refuse(f"--image-size: {','.join(map(str, args.image_size))} is a volume's patch; the stage cut "
                   f"(--model) is computed for images (--image-size N). train checks a volume's cut before its "
                   f"first step; drop --model to see the volume's tiles")
        try:
            print(f"\nstage cut of {args.model}:\n{model_cut(args, cfg)}")
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
