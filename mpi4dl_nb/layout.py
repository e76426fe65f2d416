"""Rank layout: the role every rank plays in a configuration (pure, no MPI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class LayoutKnobs(Protocol):
    """What the layout reads of a configuration (``ParallelConfig`` has it; this module stays below config)."""

    @property
    def split_size(self) -> int: ...
    @property
    def spatial_size(self) -> int: ...
    @property
    def num_spatial_parts(self) -> int: ...
    @property
    def local_dp(self) -> int: ...
    @property
    def data_parallel(self) -> int: ...
    @property
    def ranks_per_replica(self) -> int: ...
    @property
    def gems(self) -> bool: ...
    @property
    def tile_grid_shape(self) -> tuple[int, ...]: ...
    @property
    def pipeline_positions(self) -> int: ...
    def chunk_stages(self, position: int) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class StageSlot:
    """One stage of one replica direction held by a rank (tile or local-DP copy)."""

    stage: int
    spatial: bool
    tile: int | None          # tile index (row-major) for spatial stages
    tile_row: int | None
    tile_col: int | None
    copy: int                 # local-DP copy index for non-spatial stages, 0 for tiles
    stage_ranks: tuple[int, ...]   # every rank holding this stage in this replica/direction
    tile_depth: int | None = None   # a volume's grid (``--slice-method DxRxC``): the tile's depth slice

    @property
    def grid_position(self) -> str:
        """Where the tile lies in its grid: ``(row,col)``, a volume's ``(depth,row,col)``; "-" for no tile."""
        if self.tile is None:
            return "-"
        depth = "" if self.tile_depth is None else f"{self.tile_depth},"
        return f"({depth}{self.tile_row},{self.tile_col})"


@dataclass(frozen=True)
class RankRole:
    """What one rank does: its primary stage slot and, under GEMS, its mirror slot."""

    rank: int
    replica: int               # full data-parallel replica index
    index_in_replica: int
    primary: StageSlot
    mirror: StageSlot | None   # the GEMS mirror replica's slot on this rank
    chunks: tuple[StageSlot, ...] = ()   # interleaved, zbv: the later chunks' (stages') slots on this rank

    def slots(self) -> list[tuple[int, StageSlot]]:
        """Every (direction, slot) this rank holds: primary, later virtual stages, then the mirror (1)."""
        out = [(0, self.primary)] + [(0, slot) for slot in self.chunks]
        return out + ([(1, self.mirror)] if self.mirror is not None else [])

    @property
    def stages(self) -> list[int]:
        """The stages whose parameters this rank holds, ascending."""
        return sorted({slot.stage for _, slot in self.slots()})

    @property
    def stage(self) -> int:
        return self.primary.stage

    @property
    def spatial(self) -> bool:
        return self.primary.spatial

    @property
    def tile(self) -> int | None:
        return self.primary.tile

    @property
    def local_dp_index(self) -> int:
        return self.primary.copy

    def describe(self) -> str:
        """One-line human description of the role."""
        def slot_text(slot: StageSlot) -> str:
            if slot.spatial:
                depth = "" if slot.tile_depth is None else f"d{slot.tile_depth},"
                return f"stage {slot.stage} tile {slot.tile} ({depth}r{slot.tile_row},c{slot.tile_col})"
            return f"stage {slot.stage}" + (f" copy {slot.copy}" if len(slot.stage_ranks) > 1 else "")
        text = ", ".join(slot_text(slot) for slot in (self.primary, *self.chunks))
        if self.mirror is not None:
            text += f" | mirror {slot_text(self.mirror)}"
        return text


def _replica_slots(cfg: LayoutKnobs, base: int) -> list[StageSlot]:
    """Primary slots of the ranks of one replica, in in-replica index order."""
    shape = cfg.tile_grid_shape   # (rows, cols), a volume's (depth, rows, cols); numbered row-major
    cols, per_slice = shape[-1], shape[-2] * shape[-1]
    slots: list[StageSlot] = []
    offset = 0
    for stage in range(cfg.pipeline_positions):
        spatial = stage < cfg.spatial_size
        count = cfg.num_spatial_parts if spatial else cfg.local_dp
        ranks = tuple(base + offset + k for k in range(count))
        for k in range(count):
            if spatial:
                depth = k // per_slice if len(shape) == 3 else None
                slots.append(StageSlot(stage, True, k, k % per_slice // cols, k % cols, 0, ranks, depth))
            else:
                slots.append(StageSlot(stage, False, None, None, None, k, ranks))
        offset += count
    return slots


def _chunk_slots(cfg: LayoutKnobs, primary: list[StageSlot]) -> list[tuple[StageSlot, ...]]:
    """Interleaved, zbv: in-replica index i also holds its position's later chunks (``cfg.chunk_stages``),
    layer stages (spatial stages lie in the first chunk); on a spatial position its tile 0 holds them."""
    out = []
    for slot in primary:
        holder = slot.stage_ranks[:1] if slot.spatial else slot.stage_ranks
        held = slot.tile in (None, 0)
        later = cfg.chunk_stages(slot.stage)[1:]
        out.append(tuple(StageSlot(stage, False, None, None, None, slot.copy, holder)
                         for stage in later) if held else ())
    return out


def _mirror_slots(cfg: LayoutKnobs, base: int) -> list[StageSlot]:
    """Mirror slots: in-replica index i plays the primary role of index R-1-i."""
    primary = _replica_slots(cfg, base)
    size = len(primary)
    flip = {base + i: base + size - 1 - i for i in range(size)}
    mirrored = []
    for i in range(size):
        slot = primary[size - 1 - i]
        ranks = tuple(flip[r] for r in slot.stage_ranks)
        mirrored.append(StageSlot(slot.stage, slot.spatial, slot.tile, slot.tile_row,
                                  slot.tile_col, slot.copy, ranks, slot.tile_depth))
    return mirrored


def layout(cfg: LayoutKnobs) -> list[RankRole]:
    """The role of every rank of ``cfg``, indexed by global rank."""
    roles: list[RankRole] = []
    size = cfg.ranks_per_replica
    for replica in range(cfg.data_parallel):
        base = replica * size
        primary = _replica_slots(cfg, base)
        mirror = _mirror_slots(cfg, base) if cfg.gems else [None] * size
        chunks = _chunk_slots(cfg, primary)
        for i in range(size):
            roles.append(RankRole(base + i, replica, i, primary[i], mirror[i], chunks[i]))
    return roles


def stage_holders(cfg: LayoutKnobs, stage: int) -> list[int]:
    """Every rank that holds ``stage``'s parameters in any role (the gradient-sum group)."""
    return sorted({role.rank for role in layout(cfg) if stage in role.stages})


def layout_table(cfg: LayoutKnobs) -> str:
    """The rank table as aligned text (what ``python -m mpi4dl_nb layout`` prints)."""
    header = ["rank", "replica", "stage", "kind", "tile", "grid pos", "copy"]
    interleaved = cfg.split_size > cfg.pipeline_positions
    if cfg.gems:
        header += ["mirror stage", "mirror tile"]
    if interleaved:
        header.append("later chunks")
    rows = [header]
    for role in layout(cfg):
        p = role.primary
        row = [str(role.rank), str(role.replica), str(p.stage),
               "spatial" if p.spatial else "layer",
               "-" if p.tile is None else str(p.tile),
               p.grid_position,
               "-" if p.spatial else str(p.copy)]
        if cfg.gems:
            m = role.mirror
            assert m is not None
            row += [str(m.stage), "-" if m.tile is None else str(m.tile)]
        if interleaved:
            row.append(",".join(str(c.stage) for c in role.chunks) or "-")
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
