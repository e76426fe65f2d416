"""The stage cut of a model for a configuration (``layout --model``): each stage's ranks, layers and output size."""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..config import ParallelConfig
from ..layout import layout
from ..models.external import layer_shapes
from ..models.normalize import STEP
from ..models.pieces import Piece
from ..pipeline.default_cut import check_fit


def layer_label(layer: nn.Module) -> str:
    """A piece by the first and last module it runs (``layer1.0``, ``avgpool .. fc``); another layer by its class."""
    if not isinstance(layer, Piece):
        return type(layer).__name__
    paths = [p for p in layer.paths if p != STEP] or list(layer.paths)
    return paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"


def ranks_text(ranks: Sequence[int]) -> str:
    """``0-3`` for a run of ranks, ``4`` for one, ``0,2`` otherwise."""
    ordered = sorted(ranks)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def stage_table(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int, channels: int = 3) -> str:
    """The engine's cut of ``layers`` for ``cfg`` at ``image_size`` px: one row per stage (ConfigError as the engine
    would refuse it: a balance that does not fit the tiles names one that does)."""
    balance = check_fit(list(layers), cfg, image_size, in_channels=channels)
    shapes = layer_shapes(layers, image_size, channels)
    roles = layout(cfg)
    rows = [("stage", "kind", "ranks", "layers", "first .. last", "output")]
    start = 0
    for stage, count in enumerate(balance):
        stop = start + count
        kind = "spatial" if stage < cfg.spatial_size else "layer"
        ranks = [r.rank for r in roles if any(d == 0 and slot.stage == stage for d, slot in r.slots())]
        first, last = layer_label(layers[start]), layer_label(layers[stop - 1])
        names = first if count == 1 else f"{first.split(' .. ')[0]} .. {last.split(' .. ')[-1]}"
        output = "x".join(str(d) for d in shapes[stop - 1][1:])
        rows.append((str(stage), kind, ranks_text(ranks), f"{start}-{stop - 1}", names, output))
        start = stop
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines) + f"\nbalance: {','.join(map(str, balance))} ({len(layers)} layers, {image_size} px images)"
