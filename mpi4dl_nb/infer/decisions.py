"""Rank 0's decisions before the first window: the map mode and outputs settled by the network, the window, its plan,
the resume point and the background windows skipped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import ConfigError
from ..data.task import Task
from ..spatial.geometry import TileGrid
from .fully_conv import FullyConvolutional, measure_field
from .job import InferJob
from .model import ModelDescription
from .outputs.kinds import OutputKind, OutputSpec, check_outputs, npy_base
from .probes import default_window, output_size
from .reader import SlideReader
from .store import Fingerprint, load_progress, progress_path, work_path
from .tile_map import MapMode, chosen_map_mode, refuse_dense_map
from .tissue import OVERVIEW_SIDE, TissueMap
from .trained import TrainedNetwork
from .windows import AxisField, WindowPlan, padded_extent


@dataclass
class Plan:
    """Rank 0's decisions, sent to every rank: the window plan, skipped windows, resume point, outputs."""

    plan: WindowPlan
    skipped: set[tuple[int, int]]
    rows_done: int
    fingerprint: Fingerprint
    out_shape: tuple[int, int, int]
    fields: tuple[AxisField, AxisField]
    window: int
    outputs: tuple[OutputSpec, ...]


def fingerprint(job: InferJob, description: ModelDescription, reader: SlideReader,
                net: FullyConvolutional) -> Fingerprint:
    """What a partial output must share with this run to be resumed."""
    checkpoint = Path(description.path)
    return {"checkpoint": str(checkpoint.resolve()), "checkpoint_bytes": checkpoint.stat().st_size,
            "checkpoint_step": description.step, "slide": str(reader.path.resolve()), "level": reader.level,
            "scale": reader.choice.scale, "slide_size": [reader.height, reader.width], "stride": net.shape.stride,
            "dtype": job.dtype, "tissue_only": job.tissue_only, "min_tissue": job.min_tissue, "tissue": str(job.tissue)}


def resolve_outputs(job: InferJob, trained: TrainedNetwork) -> tuple[OutputSpec, ...]:
    """The outputs with their kinds settled by the task; what a task cannot give is refused."""
    dense = trained.task is Task.SEGMENTATION
    specs = tuple(spec.resolved(dense) for spec in job.specs())
    for spec in specs:
        if spec.kind is OutputKind.CSV and dense:
            raise ConfigError("--output", f"{spec.path}: a .csv has one row per output cell, here per pixel of the "
                                          f"slide; write the label map (.tif), the regions (.geojson) or the "
                                          f"probabilities (.npy) instead")
    if job.heat_class is not None and job.heat_class >= trained.net.shape.classes:
        raise ConfigError("--heat-class", f"the network has {trained.net.shape.classes} classes; use "
                                          f"0..{trained.net.shape.classes - 1}")
    class_indices(job.exclude_classes, trained.classes)
    return specs


def settled_map_mode(job: InferJob, trained: TrainedNetwork) -> InferJob:
    """``job`` with its map mode settled by the network (``--map-mode auto``: tiles for a classifier of lone tiles,
    dense otherwise); a mode the network cannot run, and what tiles mode cannot do, refused naming the way out."""
    chosen = chosen_map_mode(job.map_mode, trained.lone_tiles)
    refuse_dense_map(trained.lone_tiles, chosen, trained.description.spec.label)
    if chosen == MapMode.TILES and trained.task is Task.SEGMENTATION:
        raise ConfigError("--map-mode", "tiles classifies each tile alone, but this network predicts every pixel; "
                                        "use --map-mode dense or auto (the default) for a segmentation network")
    job.check_map_mode(chosen)
    return replace(job, map_mode=chosen)


def class_indices(names: Sequence[str], classes: Sequence[str]) -> list[int]:
    """``--exclude-class`` values (names, or indices) as class indices."""
    found = []
    for name in names:
        if name in classes:
            found.append(list(classes).index(name))
        elif name.isdigit() and int(name) < len(classes):
            found.append(int(name))
        else:
            raise ConfigError("--exclude-class", f"{name!r} is not a class of this network ({', '.join(classes)})")
    return found


def decide(job: InferJob, trained: TrainedNetwork, reader: SlideReader, grid: TileGrid) -> Plan:
    """Rank 0: field, window, plan, resume point and background windows (collective errors via ``agreed``)."""
    net = trained.net
    specs = resolve_outputs(job, trained)
    fields = measure_field(net)
    height, width = padded_extent(reader.height, fields[0].unit), padded_extent(reader.width, fields[1].unit)
    if min(height, width) < net.shape.min_side:
        raise ConfigError("--slide", f"{reader.path} is {reader.width}x{reader.height} px as read "
                          f"({reader.read_description()}), smaller than one output cell's patch "
                          f"({net.shape.min_side} px); use a finer level or --mpp, or a larger slide")
    out_h, out_w = output_size(net, height, width)
    out_shape = (net.shape.classes, out_h, out_w)
    stamp = fingerprint(job, trained.description, reader, net)
    work = work_path(npy_base(specs))
    progress = load_progress(progress_path(work))
    rows_done = 0
    if job.resume:
        if progress is not None and work.is_file():
            if progress.fingerprint != stamp:
                changed = [k for k in stamp if progress.fingerprint.get(k) != stamp[k]]
                raise ConfigError("--resume-outputs", f"the partial output {work} was made with other "
                                  f"{', '.join(changed)}; rerun with the same checkpoint, slide and options, or "
                                  f"drop --resume-outputs and pass --overwrite")
            rows_done = progress.rows_done
        check_outputs([p for p in specs if p.path != work], job.overwrite)
    else:
        if work.exists() and not job.overwrite:
            raise ConfigError("--resume-outputs", f"a partial output {work} exists; pass --resume-outputs to "
                              f"continue it, or --overwrite to start again")
        check_outputs(specs, job.overwrite)
    window = job.slide_window() or default_window(net, fields, grid, job.memory_budget,
                                               job.torch_dtype, (reader.height, reader.width))
    plan = WindowPlan(height, width, out_h, out_w, fields[0], fields[1], grid, window, first_row=rows_done)
    skipped: set[tuple[int, int]] = set()
    if job.tissue_only:
        tissue = TissueMap.from_overview(reader.thumbnail(OVERVIEW_SIDE), reader.height, reader.width, job.tissue)
        skipped = {(w.row, w.col) for w in plan.windows()
                   if tissue.fraction(w.core_footprint()) <= job.min_tissue}
    return Plan(plan, skipped, rows_done, stamp, out_shape, fields, window, specs)

