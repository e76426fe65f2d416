"""Pure matplotlib drawings: rank layout, tiles and halos over an image, Gantt timeline, memory bars.

Every function takes an optional ``ax`` and returns the Figure. Artists carry a ``gid``
(e.g. ``"rank:3"``, ``"halo:tile2:top"``, ``"msg:rows:0->2"``, ``"event:1:F"``) so tests and
widgets can find what was drawn.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from ..comm.trace import Event
from ..config import ParallelConfig
from ..layout import layout
from ..pipeline.actions import COMPUTE_KINDS, Action, ActionKind
from ..pipeline.schedules import Schedule
from ..spatial.geometry import LayerHalo, Message, TileGrid, TileHalo

if TYPE_CHECKING:
    import numpy as np
    import torch

TraceRecord = Event | Mapping[str, object]   # a trace Event, or one as a dict (``Event.as_dict``, JSON)

STAGE_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860",
                "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")
SIDES = ("top", "bottom", "left", "right")
CHUNK_COLORS = ("#1B9E77", "#E7298A", "#E6AB02", "#66A61E")   # a rank's chunks: apart from the action colours


def stage_color(stage: int) -> str:
    return STAGE_COLORS[stage % len(STAGE_COLORS)]


@dataclass(frozen=True)
class OpStyle:
    """How a family of trace ops is drawn: its name in legends and filters, its bar colour."""

    label: str
    color: str


class OpFamily(Enum):
    """The families of trace ops a timeline tells apart, each with its own colour (in legend order)."""

    FORWARD = OpStyle("forward", "#4C72B0")
    BACKWARD = OpStyle("backward", "#DD8452")
    INPUT_GRADIENT = OpStyle("input gradient", "#A6361C")     # a split backward's I (zero-bubble schedules)
    WEIGHT_GRADIENT = OpStyle("weight gradient", "#7A0177")   # a split backward's W
    HALO_FORWARD = OpStyle("halo forward", "#C44E52")
    HALO_BACKWARD = OpStyle("halo backward", "#F2A7B5")
    SEND_ACTIVATION = OpStyle("send activation", "#55A868")
    RECEIVE_ACTIVATION = OpStyle("receive activation", "#8172B3")
    SEND_GRADIENT = OpStyle("send gradient", "#64B5CD")
    RECEIVE_GRADIENT = OpStyle("receive gradient", "#CCB974")
    ALLREDUCE = OpStyle("all-reduce", "#937860")
    OPTIMIZER = OpStyle("optimizer", "#8C8C8C")
    WAIT = OpStyle("wait", "#DDDDDD")

    @property
    def label(self) -> str:
        return self.value.label

    @property
    def color(self) -> str:
        return self.value.color


ACTION_FAMILIES = {ActionKind.FORWARD: OpFamily.FORWARD, ActionKind.BACKWARD: OpFamily.BACKWARD,
                   ActionKind.BACKWARD_INPUT: OpFamily.INPUT_GRADIENT,
                   ActionKind.BACKWARD_WEIGHT: OpFamily.WEIGHT_GRADIENT,
                   ActionKind.SEND_ACT: OpFamily.SEND_ACTIVATION, ActionKind.RECV_ACT: OpFamily.RECEIVE_ACTIVATION,
                   ActionKind.SEND_GRAD: OpFamily.SEND_GRADIENT, ActionKind.RECV_GRAD: OpFamily.RECEIVE_GRADIENT,
                   ActionKind.ALLREDUCE: OpFamily.ALLREDUCE, ActionKind.OPTIM: OpFamily.OPTIMIZER}
ACTION_OPS = {kind.value: family for kind, family in ACTION_FAMILIES.items()}   # trace ops of actions: kind values
# other op names, by prefix (lower case, the first match wins): the halo exchange's (spatial/halo.py) and older ones
OP_PREFIXES = (("halo_backward", OpFamily.HALO_BACKWARD), ("halo", OpFamily.HALO_FORWARD),
               ("allreduce", OpFamily.ALLREDUCE), ("all_reduce", OpFamily.ALLREDUCE),
               ("optim", OpFamily.OPTIMIZER), ("forward", OpFamily.FORWARD), ("backward", OpFamily.BACKWARD),
               ("wait", OpFamily.WAIT))
OTHER_OP_COLOR = "#333333"   # an op of no family: drawn dark, named by its own key


def op_key(op: str) -> str:
    """The op's name without its detail: ``halo:top`` -> ``halo``."""
    return op.split(":")[0]


def op_family(op: str) -> OpFamily | None:
    """The family of a trace op: a schedule action's by its kind (``RECV_GRAD``), a halo exchange's
    (``halo``, ``halo_backward``) or an older name by prefix; None for any other op."""
    key = op_key(op).split(" ")[0]
    by_action = ACTION_OPS.get(key)
    if by_action is not None:
        return by_action
    lowered = key.lower()
    return next((family for prefix, family in OP_PREFIXES if lowered.startswith(prefix)), None)


def op_color(op: str) -> str:
    """Colour of a trace op: its family's, else a dark grey."""
    family = op_family(op)
    return OTHER_OP_COLOR if family is None else family.color


def op_label(op: str) -> str:
    """The name a legend and a filter give a trace op: its family's (``halo backward``), else its key."""
    family = op_family(op)
    return op_key(op) if family is None else family.label


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        figure = ax.get_figure(root=True)
        if figure is None:
            raise ValueError("ax belongs to no figure: draw on an Axes of a matplotlib Figure")
        return figure, ax
    fig = Figure(figsize=figsize)
    return fig, fig.add_subplot(1, 1, 1)


# ------------------------------------------------------------------------ rank layout
def draw_rank_layout(cfg: ParallelConfig, ax: Axes | None = None) -> Figure:
    """Every rank as a box coloured by its stage, grouped by replica; tiles drawn as a grid.

    Columns are stages left to right; spatial stages show their tile grid (a volume's: its depth
    slices side by side, each box labelled with its depth slice ``d``), LP stages their
    local-DP copies stacked; data-parallel replicas are stacked vertically. Under GEMS
    each box also names its mirror stage.
    """
    roles = layout(cfg)
    *depth_grid, rows_grid, cols_grid = cfg.tile_grid_shape
    slabs = depth_grid[0] if depth_grid else 1       # a volume's grid: its depth slices side by side
    cell_h = max(rows_grid, cfg.local_dp, 1)
    fig, ax = _axes(ax, (2.2 * cfg.split_size + 1, 1.4 * cell_h * cfg.data_parallel + 1))
    replica_h = cell_h + 0.8
    for role in roles:
        slot = role.primary
        y0 = (cfg.data_parallel - 1 - role.replica) * replica_h
        x0 = slot.stage * 2.0
        if slot.spatial:
            assert slot.tile_row is not None and slot.tile_col is not None   # a tile's slot has its place
            w, h = 1.6 / (cols_grid * slabs), cell_h / rows_grid
            column = (slot.tile_depth or 0) * cols_grid + slot.tile_col
            x, y = x0 + column * w, y0 + (rows_grid - 1 - slot.tile_row) * h
        else:
            w, h = 1.6, cell_h / cfg.local_dp
            x, y = x0, y0 + (cfg.local_dp - 1 - slot.copy) * h
        box = Rectangle((x, y), w * 0.96, h * 0.94, facecolor=stage_color(slot.stage),
                        edgecolor="black", alpha=0.85, gid=f"rank:{role.rank}")
        ax.add_patch(box)
        label = f"r{role.rank}"
        if slot.spatial:
            label += f"\nt{slot.tile}" + ("" if slot.tile_depth is None else f"\nd{slot.tile_depth}")
        if role.chunks:   # interleaved: the later chunks this rank also holds
            label += "\n+" + ",".join(f"S{chunk.stage}" for chunk in role.chunks)
        if role.mirror is not None:
            label += f"\nm:S{role.mirror.stage}"
        ax.text(x + w * 0.48, y + h * 0.47, label, ha="center", va="center", fontsize=8,
                color="white", gid=f"rank-label:{role.rank}")
    for stage in range(cfg.split_size):
        kind = "spatial" if stage < cfg.spatial_size else "layer"
        ax.text(stage * 2.0 + 0.8, cfg.data_parallel * replica_h - 0.55, f"stage {stage}\n({kind})",
                ha="center", va="bottom", fontsize=9, gid=f"stage-label:{stage}")
        if stage + 1 < cfg.split_size:
            for replica in range(cfg.data_parallel):
                y = (cfg.data_parallel - 1 - replica) * replica_h + cell_h / 2
                ax.add_patch(FancyArrowPatch((stage * 2.0 + 1.6, y), (stage * 2.0 + 2.0, y),
                                             arrowstyle="->", mutation_scale=10,
                                             gid=f"flow:{replica}:{stage}"))
    ax.set_xlim(-0.2, cfg.split_size * 2.0)
    ax.set_ylim(-0.3, cfg.data_parallel * replica_h + 0.6)
    ax.set_axis_off()
    gems = f", GEMS times={cfg.times}" if cfg.gems else ""
    cut = "x".join(map(str, cfg.tile_grid_shape)) if depth_grid else cfg.slice_method
    spatial = (f"spatial {cfg.spatial_size} x {cfg.num_spatial_parts} tiles ({cut}), "
               if cfg.spatial_size else "")
    ax.set_title(f"{cfg.world_size} ranks: split {cfg.split_size}, {spatial}parts {cfg.parts}, "
                 f"local_dp {cfg.local_dp}, dp {cfg.data_parallel}{gems}", fontsize=9)
    return fig


# ------------------------------------------------------ tiles and halos: an image, or a slice through a volume
FACES = ("front", "back", "top", "bottom", "left", "right")   # a volume tile's faces: along depth, then in-plane


def halo_bands(tile_halo: TileHalo, height: int, width: int) -> dict[str, tuple[int, int, int, int]]:
    """Per side, the box (r0, r1, c0, c1) of rows/cols a tile receives (inside the image).

    Top/bottom bands span the owned columns; left/right bands span the full needed rows,
    so the corner pieces belong to the left/right bands, as in the two-phase exchange.
    Keys of absent bands are missing; ``*_corner`` keys are the corner parts alone.
    """
    r0, r1, c0, c1 = tile_halo.owned_box
    n0, n1, m0, m1 = tile_halo.needed_box
    n0, n1, m0, m1 = max(n0, 0), min(n1, height), max(m0, 0), min(m1, width)
    bands: dict[str, tuple[int, int, int, int]] = {}
    if n0 < r0:
        bands["top"] = (n0, r0, max(c0, m0), min(c1, m1))
    if n1 > r1:
        bands["bottom"] = (r1, n1, max(c0, m0), min(c1, m1))
    if m0 < c0:
        bands["left"] = (n0, n1, m0, c0)
    if m1 > c1:
        bands["right"] = (n0, n1, c1, m1)
    for vert, (a, b) in (("top", (n0, r0)), ("bottom", (r1, n1))):
        for horiz, (c, d) in (("left", (m0, c0)), ("right", (c1, m1))):
            if b > a and d > c:
                bands[f"{vert}_{horiz}_corner"] = (a, b, c, d)
    return bands


def face_halos(tile_halo: TileHalo) -> dict[str, int]:
    """A volume tile's halo depth on each of its six faces (``FACES``: front/back along depth, then
    top/bottom/left/right), padding counted in, negative = trimmed (as ``TileHalo.halo`` counts)."""
    if tile_halo.depth is None:
        raise ValueError(f"tile {tile_halo.tile} belongs to an image's grid: it has four sides, not six faces")
    return {"front": tile_halo.depth.halo_before, "back": tile_halo.depth.halo_after, **tile_halo.halo}


def volume_slice(volume: np.ndarray | torch.Tensor, depth_index: int) -> np.ndarray:
    """Slice ``depth_index`` of a volume as an HxW(xC) picture: a tensor ``(D, H, W)`` or ``(C, D, H, W)``,
    an array ``(D, H, W)`` or ``(D, H, W, C)``."""
    import numpy as np

    depth = volume_depth(volume)
    if not 0 <= depth_index < depth:
        raise ValueError(f"depth_index {depth_index} outside a volume of {depth} slices (0..{depth - 1})")
    picture = volume[depth_index] if isinstance(volume, np.ndarray) else as_picture(
        volume[depth_index] if volume.ndim == 3 else volume[:, depth_index])
    return picture[..., 0] if picture.ndim == 3 and picture.shape[-1] == 1 else picture   # one channel: grey


def volume_depth(volume: np.ndarray | torch.Tensor) -> int:
    """How many slices ``volume`` has (see ``volume_slice`` for its layouts)."""
    import numpy as np

    if volume.ndim not in (3, 4):
        raise ValueError(f"a volume is (D, H, W), (C, D, H, W) (tensor) or (D, H, W, C) (array); got the "
                         f"shape {tuple(volume.shape)}")
    channels_first = not isinstance(volume, np.ndarray) and volume.ndim == 4
    return int(volume.shape[1] if channels_first else volume.shape[0])


def slice_tiles(grid: TileGrid, sizes: Sequence[int], depth: int | None) -> list[int]:
    """The tiles of ``grid`` that own feature slice ``depth`` of a ``sizes`` map (an image's grid: every tile)."""
    if depth is None:
        return list(range(grid.num_tiles))
    return [tile for tile in range(grid.num_tiles) if grid.extent(tile, sizes)[0][0] <= depth
            < grid.extent(tile, sizes)[0][1]]


@dataclass(frozen=True)
class _View:
    """What one drawing shows: the picture (an image, or slice ``index`` of a volume of ``depth`` slices), the
    feature map's sizes on the grid, the feature slice ``z`` (a volume's) and the scale from feature to picture
    pixels (rows, columns)."""

    picture: np.ndarray
    sizes: tuple[int, ...]
    scale: tuple[float, float]
    z: int | None = None
    index: int = 0
    depth: int = 1


def _view(source: np.ndarray | torch.Tensor, grid: TileGrid, halo: LayerHalo | None, depth_index: int | None
          ) -> _View:
    if halo is not None and halo.grid.ndim != grid.ndim:
        kind = "a volume's" if halo.grid.volumetric else "an image's"
        raise ValueError(f"{halo.name}: {kind} halo on {grid}; draw a halo of the grid's own kind")
    if not grid.volumetric:
        if depth_index is not None:
            raise ValueError(f"{grid} tiles images: depth_index {depth_index} needs a volume's grid (TileGrid with "
                             f"depth); leave it out to draw an image")
        picture = as_picture(source)
        sizes: tuple[int, ...] = halo.sizes if halo is not None else tuple(picture.shape[:2])
        return _View(picture, sizes, (picture.shape[0] / sizes[0], picture.shape[1] / sizes[1]))
    index = 0 if depth_index is None else depth_index
    picture = volume_slice(source, index)
    depth = volume_depth(source)
    sizes = halo.sizes if halo is not None else (depth, *picture.shape[:2])
    return _View(picture, sizes, (picture.shape[0] / sizes[1], picture.shape[1] / sizes[2]),
                 index * sizes[0] // depth, index, depth)   # z: the feature slice this volume slice falls in


def draw_tiles_and_halos(image: np.ndarray | torch.Tensor, grid: TileGrid, halo: LayerHalo | None = None, *,
                         depth_index: int | None = None, tiles: Sequence[int] | None = None,
                         show_messages: bool = True, ax: Axes | None = None) -> Figure:
    """An image with the tile grid, the halo bands of ``halo`` (a geometry.LayerHalo) for the
    chosen ``tiles`` (default all), and arrows of what each rank sends where; on a volume's grid, slice
    ``depth_index`` (default 0) of the volume ``image`` with the tiles that own it and the halo in that slice.

    The halo geometry lives on the layer's feature map (``halo.sizes``); it is scaled onto the image. An image
    is HxW or HxWxC (numpy, or a CxHxW tensor); a volume a tensor ``(D, H, W)`` / ``(C, D, H, W)`` or an array
    ``(D, H, W)`` / ``(D, H, W, C)``. A volume's tile whose own slices hold the slice draws its in-plane bands
    (``halo:tile<t>:top``...; corners hatched); one for which the slice is in its depth halo draws its face
    (``halo:tile<t>:front`` or ``:back``, sent by the depth neighbour in the first phase) and the face's edges
    (``halo:tile<t>:front_top``..., hatched: they come in the later phases). Arrows: the in-plane messages.
    """
    view = _view(image, grid, halo, depth_index)
    img_h, img_w = view.picture.shape[:2]
    sy, sx = view.scale
    fig, ax = _axes(ax, (6, 6))
    grey = view.z is not None and view.picture.ndim == 2
    ax.imshow(view.picture, extent=(0, img_w, img_h, 0), gid="image", cmap="gray" if grey else None)
    here = slice_tiles(grid, view.sizes, view.z)
    centers: dict[int, tuple[float, float]] = {}
    for tile in here:
        (r0, r1), (c0, c1) = grid.extent(tile, view.sizes)[-2:]
        centers[tile] = ((c0 + c1) / 2 * sx, (r0 + r1) / 2 * sy)
        ax.add_patch(Rectangle((c0 * sx, r0 * sy), (c1 - c0) * sx, (r1 - r0) * sy, fill=False,
                               edgecolor="white", linewidth=1.5, gid=f"tile:{tile}"))
        ax.text(*centers[tile], f"rank tile {tile}", color="white", ha="center", va="center", fontsize=9,
                gid=f"tile-label:{tile}", bbox={"facecolor": "black", "alpha": 0.4, "pad": 2})
    if halo is not None:
        for tile in range(grid.num_tiles) if tiles is None else tiles:
            _draw_tile_halo(ax, halo.tile(tile), view)
        if show_messages:
            _draw_messages(ax, _in_plane(halo, view.z), centers, tiles, (img_h, img_w))
    ax.set_title(_title(grid, halo, view, here, tiles), fontsize=9 if view.z is None else 8)
    ax.set_xlim(0, img_w)
    ax.set_ylim(img_h, 0)
    return fig


def _in_plane(halo: LayerHalo, z: int | None) -> list[Message]:
    """The messages drawn as arrows: every message of an image's exchange; a volume's rows and columns messages
    that carry feature slice ``z``."""
    if z is None:
        return halo.messages()
    return [m for m in halo.messages() if m.phase != "depth" and m.depth is not None and m.depth[0] <= z < m.depth[1]]


def _title(grid: TileGrid, halo: LayerHalo | None, view: _View, here: list[int], tiles: Sequence[int] | None
           ) -> str:
    shape = "x".join(map(str, grid.shape))
    img_h, img_w = view.picture.shape[:2]
    if view.z is None:
        if halo is None:
            return f"{img_h}x{img_w} image on {shape} tiles"
        return (f"{halo.name}: {halo.height}x{halo.width} map on {shape} tiles, "
                f"{halo.message_count} messages (rows: yellow, cols+corners: cyan)")
    where = f"slice {view.index} of {view.depth}"
    if halo is None:
        return f"{where}: {view.depth}x{img_h}x{img_w} volume\non {shape} tiles (here: {here})"
    faces = ""
    if tiles is not None and len(tiles) == 1:
        widths = face_halos(halo.tile(tiles[0]))
        faces = f"\ntile {tiles[0]}'s halo per face: " + ", ".join(f"{face} {widths[face]}" for face in FACES)
    return (f"{halo.name}: {where} (feature slice {view.z} of {view.sizes[0]})\non {shape} tiles, "
            f"{halo.message_count} messages{faces}")


def _draw_tile_halo(ax: Axes, tile_halo: TileHalo, view: _View) -> None:
    """What ``tile_halo``'s tile receives in the drawn slice: its in-plane bands, or (a volume's slice in its depth
    halo) the depth face and its edges."""
    face = None
    if tile_halo.depth is not None:
        (own0, own1), (need0, need1) = tile_halo.depth.owned, tile_halo.depth.needed
        assert view.z is not None
        if not max(need0, 0) <= view.z < min(need1, tile_halo.depth.size):
            return                                          # this slice is neither the tile's nor its halo's
        face = None if own0 <= view.z < own1 else ("front" if view.z < own0 else "back")
    sy, sx = view.scale
    color = stage_color(tile_halo.tile)
    prefix = "" if face is None else f"{face}_"
    if face is not None:
        r0, r1, c0, c1 = tile_halo.owned_box
        ax.add_patch(Rectangle((c0 * sx, r0 * sy), (c1 - c0) * sx, (r1 - r0) * sy, facecolor=color, alpha=0.6,
                               edgecolor=color, linewidth=2, gid=f"halo:tile{tile_halo.tile}:{face}"))
    for side, (r0, r1, c0, c1) in halo_bands(tile_halo, *view.sizes[-2:]).items():
        hatched = face is not None or side.endswith("corner")
        ax.add_patch(Rectangle((c0 * sx, r0 * sy), (c1 - c0) * sx, (r1 - r0) * sy, facecolor=color,
                               alpha=0.25 if hatched else 0.45, edgecolor=color, hatch="//" if hatched else None,
                               gid=f"halo:tile{tile_halo.tile}:{prefix}{side}"))


def _draw_messages(ax: Axes, messages: Iterable[Message], centers: Mapping[int, tuple[float, float]],
                   tiles: Sequence[int] | None, picture_size: tuple[int, int]) -> None:
    """An arrow (rows phase: yellow, cols phase: cyan) from each message's sender's centre to its receiver's,
    labelled with its element count; only messages of ``tiles`` (default all) between tiles in ``centers``."""
    img_h, img_w = picture_size
    for msg in messages:
        if tiles is not None and msg.dst not in tiles and msg.src not in tiles:
            continue
        if msg.src not in centers or msg.dst not in centers:
            continue
        (x0, y0), (x1, y1) = centers[msg.src], centers[msg.dst]
        shift = 0.06 * (img_w if msg.phase == "rows" else img_h)
        offset = (shift, 0) if msg.phase == "rows" else (0, shift)
        sign = 1 if msg.src < msg.dst else -1
        start = (x0 + sign * offset[0], y0 + sign * offset[1])
        end = (x1 + sign * offset[0], y1 + sign * offset[1])
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12,
                                     color="yellow" if msg.phase == "rows" else "cyan",
                                     linewidth=1.5, gid=f"msg:{msg.phase}:{msg.src}->{msg.dst}"))
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2, f"{msg.elements}",
                fontsize=7, color="black", ha="center",
                bbox={"facecolor": "white", "alpha": 0.7, "pad": 1},
                gid=f"msg-label:{msg.phase}:{msg.src}->{msg.dst}")


def as_picture(image: np.ndarray | torch.Tensor) -> np.ndarray:
    """An HxW(xC) array of ``image``: an array as it is, a tensor on the CPU (CxHxW with 1 or 3 channels
    turned to HxWxC)."""
    import numpy as np

    if isinstance(image, np.ndarray):
        return image
    tensor = image.detach().cpu()
    return np.asarray(tensor.permute(1, 2, 0) if tensor.ndim == 3 and tensor.shape[0] in (1, 3) else tensor)


# --------------------------------------------------------------------------- timeline
def as_event(record: TraceRecord) -> Event:
    """``record`` as a trace Event (a dict's missing or non-numeric fields at their defaults)."""
    if isinstance(record, Event):
        return record

    def whole(key: str) -> int | None:
        value = record.get(key)
        return int(value) if isinstance(value, (int, float)) else None

    def seconds(key: str) -> float:
        value = record.get(key)
        return float(value) if isinstance(value, (int, float)) else 0.0

    extra = record.get("extra")
    return Event(rank=whole("rank") or 0, op=str(record.get("op", "")), start=seconds("start"), end=seconds("end"),
                 stage=whole("stage"), micro_batch=whole("micro_batch"), replica=whole("replica"),
                 bytes=whole("bytes") or 0, peer=whole("peer"),
                 extra={str(k): v for k, v in extra.items()} if isinstance(extra, Mapping) else {})


def legend_entries(ops: Iterable[str]) -> dict[str, str]:
    """Legend name -> colour of the ops drawn: families in ``OpFamily`` order, then other ops as they come."""
    drawn = list(ops)
    families = {op_family(op) for op in drawn}
    entries = {family.label: family.color for family in OpFamily if family in families}
    for op in drawn:
        if op_family(op) is None:
            entries.setdefault(op_key(op), OTHER_OP_COLOR)
    return entries


def draw_timeline(events: Sequence[TraceRecord], ax: Axes | None = None, *, highlight: int | None = None) -> Figure:
    """Gantt chart: one row per rank, one bar per event (Event objects or dicts), coloured by its op's family
    (``OpFamily``: halo forward and backward, activation and gradient sends and receives each their own), with a
    legend naming the families drawn, right of the plot.

    A compute bar is labelled with its micro-batch and, where a rank ran several stages (interleaved,
    V-shaped: its chunks), the stage: ``2@s3``.

    ``highlight``: index into ``events`` drawn with a thick outline (the stepper's cursor).
    """
    rows = [as_event(e) for e in events]
    ranks = sorted({r.rank for r in rows}) or [0]
    stages_of: dict[int, set[int | None]] = {}
    for r in rows:
        if r.op in COMPUTE_KINDS:
            stages_of.setdefault(r.rank, set()).add(r.stage)
    chunked = any(len(stages) > 1 for stages in stages_of.values())
    fig, ax = _axes(ax, (9, 0.5 * len(ranks) + 1.5))
    t0 = min((r.start for r in rows), default=0.0)
    for index, r in enumerate(rows):
        width = max(r.end - r.start, 1e-9)
        outline = ("black", 2.5) if index == highlight else ("white", 0.3)
        ax.broken_barh([(r.start - t0, width)], (r.rank - 0.4, 0.8), facecolors=op_color(r.op), edgecolor=outline[0],
                       linewidth=outline[1], gid=f"event:{index}:{r.rank}:{r.op}")
        mb = r.micro_batch
        if mb is not None and mb >= 0 and r.op in COMPUTE_KINDS:
            text = f"{mb}@s{r.stage}" if chunked and r.stage is not None else str(mb)
            ax.text(r.start - t0 + width / 2, r.rank, text, ha="center", va="center",
                    fontsize=6, color="white", gid=f"event-label:{index}")
    legend = legend_entries(r.op for r in rows)
    if legend:   # right of the plot: below it the legend would cover the x-axis label on a short (1-rank) chart
        ax.legend(handles=[Patch(facecolor=color, label=label) for label, color in legend.items()], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False, borderaxespad=0.0)
    end = max((r.end - t0 for r in rows), default=1.0)
    ax.set_xlim(0, end * 1.02 if end > 0 else 1.0)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"timeline of {len(rows)} events on {len(ranks)} ranks", fontsize=9)
    return fig


# --------------------------------------------------------------------------- schedule
SCHEDULE_COLORS = {kind: family.color for kind, family in ACTION_FAMILIES.items()}   # as in the timeline


def schedule_legend(schedule: Schedule) -> dict[str, str]:
    """Legend name -> colour of a schedule drawing: the action kinds it has (forward, backward or its
    input- and weight-gradient parts, all-reduce, optimizer), then, where a rank holds several
    stages (interleaved, V-shaped), each stage's chunk colour (the strip under its cells)."""
    kinds = {a.kind for actions in schedule.per_rank for a in actions if not a.kind.is_p2p}
    entries = {ACTION_FAMILIES[kind].label: SCHEDULE_COLORS[kind] for kind in ActionKind if kind in kinds}
    if schedule.cfg.virtual_stages > 1:
        positions = schedule.cfg.pipeline_positions
        stages = sorted({a.stage for actions in schedule.per_rank for a in actions if a.kind.is_compute})
        for chunk in sorted({stage // positions for stage in stages}):
            mine = ",".join(f"s{stage}" for stage in stages if stage // positions == chunk)
            entries[f"chunk {chunk} ({mine})"] = chunk_color(chunk)
    return entries


def chunk_color(chunk: int) -> str:
    """Colour of a rank's ``chunk``-th stage (interleaved, V-shaped: stage // pipeline positions)."""
    return CHUNK_COLORS[chunk % len(CHUNK_COLORS)]


def draw_schedule(schedule: Schedule, done: int = 0, ax: Axes | None = None) -> Figure:
    """A schedule as a grid (ticks across, ranks down): F/B (or I/W)/AR/OPT cells, solid when among
    the first ``done`` actions of ``schedule.global_order()``, pale otherwise; the last done
    action is outlined and, if it is a send/receive, drawn as an arrow to its peer. Where a rank
    holds several stages, a strip in the stage's colour under each compute cell says which; a
    legend right of the grid names the colours (``schedule_legend``).
    """
    order = schedule.global_order()
    done_ids = {id(a) for a in order[:done]}
    current = order[done - 1] if 0 < done <= len(order) else None
    fig, ax = _axes(ax, (max(6, 0.55 * schedule.num_ticks + 1.5), 0.5 * schedule.world_size + 1.5))
    local_dp, show_stage = schedule.cfg.local_dp, schedule.cfg.virtual_stages > 1
    for rank, actions in enumerate(schedule.per_rank):
        by_tick: dict[int, list[Action]] = {}
        for action in actions:
            if not action.kind.is_p2p:
                by_tick.setdefault(action.tick, []).append(action)
        for tick, acts in by_tick.items():
            for k, action in enumerate(acts):
                width = 0.9 / len(acts)
                solid = id(action) in done_ids
                is_current = current is not None and action is current
                ax.add_patch(Rectangle((tick + 0.05 + k * width, rank - 0.4), width, 0.8,
                                       facecolor=SCHEDULE_COLORS[action.kind],
                                       alpha=0.95 if solid else 0.2,
                                       edgecolor="black" if is_current else "white",
                                       linewidth=2.5 if is_current else 0.5,
                                       gid=f"cell:{'done' if solid else 'todo'}:{rank}:{tick}:"
                                           f"{action.label(local_dp, show_stage)}"))
                ax.text(tick + 0.05 + (k + 0.5) * width, rank, action.label(local_dp, show_stage),
                        ha="center", va="center", fontsize=6,
                        color="white" if solid else "#555555")
                if show_stage and action.kind.is_compute:   # which of the rank's chunks
                    chunk = action.stage // schedule.cfg.pipeline_positions
                    ax.add_patch(Rectangle((tick + 0.05 + k * width, rank + 0.28), width, 0.12,
                                           facecolor=chunk_color(chunk), alpha=0.95 if solid else 0.3,
                                           linewidth=0, gid=f"chunk:{rank}:{tick}:{chunk}:s{action.stage}"))
    if current is not None and current.peer is not None:
        src, dst = (current.rank, current.peer) if current.kind.is_send else \
            (current.peer, current.rank)
        ax.add_patch(FancyArrowPatch((current.tick + 0.5, src), (current.tick + 0.5, dst),
                                     arrowstyle="-|>", mutation_scale=14, linewidth=2,
                                     color=SCHEDULE_COLORS[current.kind],
                                     gid=f"p2p:{current.kind}:{src}->{dst}"))
    ax.set_xlim(0, schedule.num_ticks)
    ax.set_ylim(schedule.world_size - 0.5, -0.5)
    ax.set_yticks(range(schedule.world_size))
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.world_size)], fontsize=8)
    ax.set_xlabel("tick")
    legend = schedule_legend(schedule)
    ax.legend(handles=[Patch(facecolor=color, label=label) for label, color in legend.items()], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    text = current.describe() if current is not None else "not started"
    ax.set_title(f"{schedule.kind} step: {done}/{len(order)} actions - {text}", fontsize=8)
    return fig


# ------------------------------------------------------------------------ memory bars
def draw_memory_bars(measured: Sequence[float] | None = None, estimate: Sequence[float] | None = None,
                     *, labels: Sequence[str] | None = None, ax: Axes | None = None,
                     unit: str = "MB") -> Figure:
    """Per-rank memory bars (bytes): measured peak and/or planner estimate side by side."""
    scale = {"B": 1, "KB": 2 ** 10, "MB": 2 ** 20, "GB": 2 ** 30}[unit]
    series = [(name, values) for name, values in (("measured", measured), ("estimate", estimate))
              if values is not None]
    if not series:
        raise ValueError("draw_memory_bars needs measured= and/or estimate= per-rank bytes")
    count = max(len(values) for _, values in series)
    fig, ax = _axes(ax, (max(4, 0.6 * count + 2), 3))
    width = 0.8 / len(series)
    colors = {"measured": "#4C72B0", "estimate": "#DD8452"}
    for k, (name, values) in enumerate(series):
        for rank, value in enumerate(values):
            ax.bar(rank + (k - (len(series) - 1) / 2) * width, value / scale, width,
                   color=colors[name], label=name if rank == 0 else None,
                   gid=f"mem:{name}:{rank}")
    ax.set_xticks(range(count))
    ax.set_xticklabels(labels or [f"r{r}" for r in range(count)], fontsize=8)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)
    ax.set_title("per-rank peak memory", fontsize=9)
    return fig


def find_artists(fig: Figure, prefix: str) -> list[Artist]:
    """Artists of ``fig`` whose gid starts with ``prefix`` (for tests and widgets)."""
    found = []
    for ax in fig.axes:
        for artist in ax.get_children():
            gid = artist.get_gid()
            if gid and gid.startswith(prefix):
                found.append(artist)
    return found


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    """The figure rendered as PNG."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def show(fig: Figure, dpi: int = 100) -> None:
    """Display a pyplot-free figure in a notebook as a PNG (nothing outside IPython)."""
    try:
        from IPython.display import Image, display
    except ImportError:  # pragma: no cover - plain Python without IPython
        return
    display(Image(data=png_bytes(fig, dpi)))


_RENAMED = {"draw_volume_tiles_and_halos": "draw_tiles_and_halos(volume, grid, halo, depth_index=...): one drawing "
                                           "for images and volumes, the grid says which"}


def __getattr__(name: str) -> object:
    """A name this module no longer has: refused naming its new spelling."""
    if name in _RENAMED:
        raise AttributeError(f"viz.{name} is now viz.{_RENAMED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
