"""What windowed attention exchanges on tiles as the planner counts it: Swin, MaxViT (pure).

Swin (``swin.py``): a block gathers every window it computes onto one tile (the roll folded in: only the tokens
that change tile move) and sends the results back (``plan.WindowLayout``); a patch merge gathers every 2x2 (2x2x2)
neighbourhood to the tile of its merged token (``plan.plan_merge``). Tokens are counted box by box: a window's source
tokens along each axis are one interval of the rolled grid (two where the roll wraps), a tile's tokens a box, so
what a tile holds of a window is a product of interval overlaps; the windows' owners are the layout's own
(``WindowLayout.owners``). MaxViT (``partition.py``): every token goes to the tile attending its block or grid
window (``owners.py``) and back, counted axis by axis. Backward sends the same bytes again, each gather's adjoint
running the other way. Bytes are per sample.
``swin_cost`` (a model), ``swin_block_cost``, ``swin_merge_cost`` and ``partition_cost`` are the families'
``cost.FamilyCost``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..cost import ExchangeBytes
from ..geometry import Range, TileGrid, split_ranges
from ..tokens.tiles import int_pair
from .plan import ShiftedWindows, TokenBoxes, WindowLayout


@dataclass(frozen=True)
class TileTraffic:
    """One tile's part of one exchange, one sample (bytes): ``sent``/``received`` in the forward (the backward
    sends what the forward received and receives what it sent); ``held``: the buffer the gather fills on the tile
    (its windows, padding included, or its merged neighbourhoods), beside the tile's own tokens."""

    tile: int
    sent: int
    received: int
    held: int


@dataclass(frozen=True)
class BlockTraffic:
    """A Swin block's window exchanges on every tile: into the windows (``into``) and back (``back``)."""

    into: tuple[TileTraffic, ...]
    back: tuple[TileTraffic, ...]

    def sent_forward(self, tile: int) -> int:
        return self.into[tile].sent + self.back[tile].sent

    def sent_backward(self, tile: int) -> int:
        """The adjoints: the gradients of the windows travel as the tokens came, reversed."""
        return self.into[tile].received + self.back[tile].received

    def largest_held(self) -> int:
        """The largest tile's gathered windows (bytes)."""
        return max(t.held for t in self.into)


def _overlap(a: Range, b: Range) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _window_spans(windows: ShiftedWindows, index: int) -> list[list[Range]]:
    """Per axis, the global (unrolled) intervals window ``index``'s non-padding slots come from."""
    spans = []
    for axis, coord in enumerate(windows.window_coords(index)):
        n, w, s = windows.sizes[axis], windows.window[axis], windows.shift[axis]
        start, stop = coord * w, min(coord * w + w, n)      # rolled positions (padding past n dropped)
        first, last = (start + s) % n, (stop - 1 + s) % n  # global coordinates of the ends
        spans.append([(first, last + 1)] if first <= last else [(first, n), (0, last + 1)])
    return spans


def _held(spans: Sequence[Sequence[Range]], extent: Sequence[Range]) -> int:
    """Tokens of a window (``spans`` per axis) that a tile of ``extent`` holds."""
    return math.prod(sum(_overlap(span, axis_range) for span in axis_spans)
                     for axis_spans, axis_range in zip(spans, extent))


def block_traffic(grid: TileGrid, sizes: Sequence[int], window: Sequence[int], shift: Sequence[int],
                  channels: int, element_bytes: int) -> BlockTraffic:
    """``BlockTraffic`` of a block over a token grid of ``sizes`` with ``window`` and ``shift`` (one per axis, as
    timm clamps them: a window no larger than the grid, no shift where it is one window), ``channels`` wide."""
    windows = ShiftedWindows(tuple(sizes), tuple(window), tuple(shift))
    layout = WindowLayout(windows, TokenBoxes(grid, tuple(sizes)))
    extents = layout.boxes.extents
    tiles = grid.num_tiles
    sent, received = [0] * tiles, [0] * tiles
    for index, owner in enumerate(layout.owners):
        spans = _window_spans(windows, index)
        for tile in range(tiles):
            if tile != owner:
                count = _held(spans, extents[tile])
                sent[tile] += count
                received[owner] += count
    token = channels * element_bytes
    held = [len(layout.owned(t)) * windows.area * token for t in range(tiles)]
    into = tuple(TileTraffic(t, sent[t] * token, received[t] * token, held[t]) for t in range(tiles))
    back = tuple(TileTraffic(t, received[t] * token, sent[t] * token, 0) for t in range(tiles))
    return BlockTraffic(into, back)


def merge_traffic(grid: TileGrid, sizes: Sequence[int], channels: int, element_bytes: int) -> tuple[TileTraffic, ...]:
    """Each tile's part of a patch merge of a ``sizes`` grid ``channels`` wide: the 2x2 (2x2x2) neighbours of its
    merged tokens (``ceil(n / 2)`` per axis, balanced split) from the tiles holding them."""
    boxes = TokenBoxes(grid, tuple(sizes))
    merged = TokenBoxes(grid, tuple((n + 1) // 2 for n in sizes))
    tiles = grid.num_tiles
    wanted = [[(2 * a, min(2 * b, n)) for (a, b), n in zip(merged.extents[t], sizes)] for t in range(tiles)]
    sent, received = [0] * tiles, [0] * tiles
    for target in range(tiles):
        for source in range(tiles):
            if source != target:
                count = math.prod(_overlap(w, e) for w, e in zip(wanted[target], boxes.extents[source]))
                sent[source] += count
                received[target] += count
    token = channels * element_bytes
    return tuple(TileTraffic(t, sent[t] * token, received[t] * token,
                             merged.count(t) * (2 ** len(sizes)) * token) for t in range(tiles))


@dataclass(frozen=True)
class SwinStage:
    """One stage of a Swin model: its token grid, blocks, window, shift of its odd blocks (as timm clamps them) and
    width; ``merged_from``: the grid its patch merge reads (None: no merge), ``merged_channels`` wide."""

    sizes: tuple[int, ...]
    depth: int
    window: tuple[int, ...]
    shift: tuple[int, ...]
    channels: int
    merged_from: tuple[int, ...] | None = None
    merged_channels: int = 0


def swin_stages(token_grid: Sequence[int], depths: Sequence[int], channels: Sequence[int],
                window: int) -> list[SwinStage]:
    """The stages of a timm Swin(V2) over a patch grid of ``token_grid``: every stage but the first merges (grids
    halved, rounded up); along an axis no longer than the window, the window is the axis, unshifted (timm's clamp);
    else the shift is half the window."""
    stages: list[SwinStage] = []
    sizes = tuple(token_grid)
    for index, (depth, width) in enumerate(zip(depths, channels)):
        previous = sizes
        if index:
            sizes = tuple((n + 1) // 2 for n in sizes)
        stage_window = tuple(min(n, window) for n in sizes)
        shift = tuple(0 if n <= window else window // 2 for n in sizes)
        stages.append(SwinStage(sizes, depth, stage_window, shift, width, previous if index else None,
                                channels[index - 1] if index else 0))
    return stages


@dataclass(frozen=True)
class StageTraffic:
    """What a stage's exchanges send per tile, one sample (bytes): its merge (none: empty) and each block."""

    merge: tuple[TileTraffic, ...]
    blocks: tuple[BlockTraffic, ...]

    def sent_forward(self, tile: int) -> int:
        merge = self.merge[tile].sent if self.merge else 0
        return merge + sum(block.sent_forward(tile) for block in self.blocks)

    def sent_backward(self, tile: int) -> int:
        merge = self.merge[tile].received if self.merge else 0
        return merge + sum(block.sent_backward(tile) for block in self.blocks)


def stage_traffic(grid: TileGrid, stage: SwinStage, element_bytes: int) -> StageTraffic:
    """``StageTraffic`` of ``stage`` on ``grid``: even blocks unshifted, odd ones shifted (one count per
    geometry)."""
    merge: tuple[TileTraffic, ...] = ()
    if stage.merged_from is not None:
        merge = merge_traffic(grid, stage.merged_from, stage.merged_channels, element_bytes)
    plain = block_traffic(grid, stage.sizes, stage.window, (0,) * len(stage.sizes), stage.channels, element_bytes)
    shifted = plain if not any(stage.shift) else \
        block_traffic(grid, stage.sizes, stage.window, stage.shift, stage.channels, element_bytes)
    return StageTraffic(merge, tuple(shifted if i % 2 else plain for i in range(stage.depth)))


def busiest(parts: Sequence[tuple[int, int, int]]) -> ExchangeBytes:
    """The busiest tile's ``ExchangeBytes`` of per-tile ``(sent, received, held)``: each the largest over the tiles (an
    upper bound on any one tile's)."""
    if not parts:
        return ExchangeBytes()
    return ExchangeBytes(max(p[0] for p in parts), max(p[1] for p in parts), max(p[2] for p in parts))


def _number(module: object, name: str) -> int:
    """``module``'s integer attribute ``name`` (a timm module's hyper-parameter)."""
    value = getattr(module, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"expected a number, got {value!r}")
    return int(value)


def swin_block_cost(module: nn.Module, grid: TileGrid, sizes: Sequence[int], element_bytes: int) -> ExchangeBytes:
    """``FamilyCost`` of a timm Swin block over ``sizes``: its window gathers into the windows and back, timm's clamp
    applied (a window no larger than the grid, no shift where it is one window)."""
    window = int_pair(getattr(module, "window_size", 0))
    shift = int_pair(getattr(module, "target_shift_size", None) or getattr(module, "shift_size", 0))
    clamped = tuple(min(n, w) for n, w in zip(sizes, window))
    shifted = tuple(0 if n <= w else s for n, w, s in zip(sizes, window, shift))
    counted = block_traffic(grid, sizes, clamped, shifted, _number(module, "dim"), element_bytes)
    return busiest([(into.sent + back.sent, into.received + back.received, into.held)
                    for into, back in zip(counted.into, counted.back)])


def swin_merge_cost(module: nn.Module, grid: TileGrid, sizes: Sequence[int], element_bytes: int) -> ExchangeBytes:
    """``FamilyCost`` of a timm Swin patch merge reading a ``sizes`` grid: the gather of its neighbourhoods."""
    counted = merge_traffic(grid, sizes, _number(module, "dim"), element_bytes)
    return busiest([(t.sent, t.received, t.held) for t in counted])


def swin_cost(module: nn.Module, grid: TileGrid, sizes: Sequence[int], element_bytes: int) -> ExchangeBytes:
    """``FamilyCost`` of a whole timm Swin (or a cut one's trunk) on images of ``sizes`` pixels (its patch grid:
    ``sizes`` over the patch size): every stage's merge and blocks, summed (held: the largest)."""
    parts: list[ExchangeBytes] = []
    patch = int_pair(getattr(getattr(module, "patch_embed", None), "patch_size", 1))
    current = tuple(n // p for n, p in zip(sizes, patch))
    for stage in getattr(module, "layers", ()):
        merge = getattr(stage, "downsample", None)
        if merge is not None and hasattr(merge, "reduction"):
            parts.append(swin_merge_cost(merge, grid, current, element_bytes))
            current = tuple((n + 1) // 2 for n in current)
        parts.extend(swin_block_cost(block, grid, current, element_bytes) for block in getattr(stage, "blocks", ()))
    return ExchangeBytes(sum(p.sent for p in parts), sum(p.received for p in parts),
                         max((p.held for p in parts), default=0))


def _owner_of(ranges: Sequence[Range], index: int) -> int:
    return next(part for part, (start, stop) in enumerate(ranges) if start <= index < stop)


def _axis_moves(length: int, size: int, block: bool, parts: int) -> list[list[int]]:
    """Along one axis of ``length`` tokens split in ``parts``: ``moves[a][b]``, the tokens of tile range ``a``
    whose window (block windows of ``size``, or a grid of ``size``: stride ``length // size``) tile range ``b``
    attends (windows split as the tile grid splits an image)."""
    lattice = length // size
    tokens, windows = split_ranges(length, parts), split_ranges(lattice, parts)
    moves = [[0] * parts for _ in range(parts)]
    for position in range(length):
        window = position // size if block else position % lattice
        moves[_owner_of(tokens, position)][_owner_of(windows, window)] += 1
    return moves


def partition_moves(grid: TileGrid, sizes: Sequence[int], size: Sequence[int],
                    block: bool) -> tuple[list[int], list[int], list[int]]:
    """Per tile of a 2-D ``grid``: tokens it sends to the other tiles' windows, tokens it receives into its windows,
    and the windows' slots it holds, for MaxViT's ``block`` (else grid) partition of ``size`` over ``sizes``."""
    axes = [_axis_moves(n, p, block, parts) for n, p, parts in zip(sizes, size, grid.shape)]
    lattice = [split_ranges(n // p, parts) for n, p, parts in zip(sizes, size, grid.shape)]
    tiles = grid.num_tiles
    sent, received = [0] * tiles, [0] * tiles
    for source in range(tiles):
        for target in range(tiles):
            if source != target:
                count = math.prod(axis[a][b] for axis, a, b in zip(axes, grid.coords(source), grid.coords(target)))
                sent[source] += count
                received[target] += count
    area = math.prod(size)
    held = [area * math.prod(r[c][1] - r[c][0] for r, c in zip(lattice, grid.coords(t))) for t in range(tiles)]
    return sent, received, held


def _channels(module: nn.Module) -> int:
    norm = getattr(module, "norm1", None)
    shape = getattr(norm, "normalized_shape", None)
    if shape:
        return int(shape[0])
    return _number(module, "dim")


def partition_cost(module: nn.Module, grid: TileGrid, sizes: Sequence[int], element_bytes: int) -> ExchangeBytes:
    """``FamilyCost`` of MaxViT's partition attention (timm's ``PartitionAttentionCl``/``2d``): every token to its
    window's tile and back (a grid that does not split into whole windows, which timm refuses, costs nothing)."""
    size = int_pair(getattr(module, "partition_size", 1))
    if grid.volumetric or any(n % p for n, p in zip(sizes, size)):
        return ExchangeBytes()
    sent, received, held = partition_moves(grid, sizes, size, bool(getattr(module, "partition_block", True)))
    token = _channels(module) * element_bytes
    return busiest([((s + r) * token, (r + s) * token, h * token) for s, r, h in zip(sent, received, held)])
