"""The stage cut of a model for a configuration (``layout --model``): each stage's ranks, layers and output size, and
the training state a rank keeps of each stage under each ZeRO stage."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch import nn

from ..config import ConfigError, ParallelConfig
from ..layout import layout, stage_holders
from ..models.external import layer_shapes
from ..models.normalize import STEP
from ..models.pieces import Piece
from ..pipeline.default_cut import check_fit
from ..planner.optimizer import TrainingState
from ..planner.tune import aligned
from ..run.zero_share import megabytes

ZERO_STAGES = (0, 1, 2, 3)


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


def underlined(rows: list[list[str]]) -> list[str]:
    """``rows`` as aligned lines (``planner.tune.aligned``: the first column left), the header underlined."""
    lines = aligned(rows, left=0)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [lines[0], "  ".join("-" * width for width in widths), *lines[1:]]


def state_table(layers: Sequence[nn.Module], cfg: ParallelConfig, image_size: int, state_slots: int,
                channels: int = 3) -> str:
    """Per stage of the engine's cut of ``layers``: its holders and the training state (float32 weights, gradients
    and ``state_slots`` optimizer states per parameter) its first holder keeps under each ZeRO stage (the largest
    share: chunks of ceil(n / holders) per parameter), ``cfg.zero_stage`` marked; then a line on what a rank
    holds only while a stage computes (``planner.optimizer.StateBytes``)."""
    balance = check_fit(list(layers), cfg, image_size, in_channels=channels)
    stages = [list(layers[a:b]) for a, b in zip((0, *itertools.accumulate(balance)), itertools.accumulate(balance))]
    states: dict[int, TrainingState | None] = {}
    for zero in ZERO_STAGES:
        try:
            states[zero] = TrainingState(cfg.with_(zero_stage=zero), stages, optimizer_states=state_slots)
        except ConfigError:              # a ZeRO stage the configuration refuses
            states[zero] = None
    marks = [f"zero-{z}" + ("*" if z == cfg.zero_stage else "") for z in ZERO_STAGES]
    rows = [["stage", "holders", "parameters", *marks]]
    for stage, held in enumerate(stages):
        first = stage_holders(cfg, stage)[0]
        cells = []
        for zero in ZERO_STAGES:
            found = states[zero]
            cells.append("refused" if found is None else megabytes(found.of(first, stage).kept))
        rows.append([str(stage), str(len(stage_holders(cfg, stage))),
                     f"{sum(p.numel() for layer in held for p in layer.parameters()):,}", *cells])
    return "\n".join([f"training state per rank of each stage, MB (float32 weights and gradients, {state_slots} "
                      f"optimizer state(s) per parameter), by --zero-stage (*: this one):", *underlined(rows),
                      "kept between steps; ZeRO 1 and 2 keep the whole weights beside the shards; while a stage "
                      "computes, ZeRO 3 gathers its weights layer by layer (two at a time), and every level builds "
                      "its whole gradients in backward (2, 3: until the reduce-scatter)"])
