"""windows.py: rolls, shifted windows, masks and patch merges as gathers on tiles equal one process (pure geometry,
each gather simulated in one process), and the bytes a shifted-window block sends."""

from __future__ import annotations

import math

import pytest
import torch

from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.windows.plan import (
    MASK_VALUE,
    ShiftedWindows,
    TileGather,
    TokenBoxes,
    WindowLayout,
    plan_gather,
    plan_merge,
    plan_roll,
)

GRIDS = [((2, 2), (13, 11)), ((1, 4), (14, 14)), ((2, 3), (7, 9)), ((2, 2, 2), (5, 6, 7)), ((1, 1, 4), (4, 5, 9))]


def grid_of(shape: tuple[int, ...]) -> TileGrid:
    return TileGrid.of_shape(shape)


def tiles_of(whole: torch.Tensor, boxes: TokenBoxes) -> list[torch.Tensor]:
    """Each tile's tokens ``(n, C)``, row-major in its box (``whole``: ``(*sizes, C)``)."""
    out = []
    for extent in boxes.extents:
        part = whole[tuple(slice(a, b) for a, b in extent)]
        out.append(part.reshape(-1, whole.shape[-1]))
    return out


def simulate(plans: list[TileGather], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tile's gather run in one process: messages handed over in plan order."""
    out = []
    for plan in plans:
        target = values[0].new_zeros((plan.size, values[0].shape[-1]))
        target[list(plan.own_targets)] = values[plan.tile][list(plan.own_sources)]
        for peer, slots in plan.receives:
            sent = dict(plans[peer].sends)[plan.tile]
            assert len(sent) == len(slots)
            target[list(slots)] = values[peer][list(sent)]
        out.append(target)
    return out


@pytest.mark.parametrize("shape,sizes", GRIDS)
@pytest.mark.parametrize("sign", [1, -1])
def test_roll_is_torch_roll_on_every_tile(shape: tuple[int, ...], sizes: tuple[int, ...], sign: int) -> None:
    boxes = TokenBoxes(grid_of(shape), sizes)
    whole = torch.randn(*sizes, 2, dtype=torch.float64)
    shifts = tuple(sign * (axis + 2) for axis in range(len(sizes)))
    rolled = simulate(plan_roll(boxes, shifts), tiles_of(whole, boxes))
    expected = tiles_of(torch.roll(whole, shifts, dims=tuple(range(len(sizes)))), boxes)
    assert all(torch.equal(a, b) for a, b in zip(rolled, expected))


def test_roll_sends_shift_slabs_to_the_next_tile_and_the_ends_wrap() -> None:
    boxes = TokenBoxes(TileGrid(1, 4), (8, 16))   # 4 columns per tile
    plans = plan_roll(boxes, (0, -3))   # Swin's roll: column c <- c + 3
    for plan in plans:
        assert [peer for peer, _ in plan.sends] == [(plan.tile - 1) % 4]
        assert plan.tokens_sent == 3 * 8
    assert all(plan.is_local for plan in plan_roll(boxes, (0, 0)))


def reference_windows(whole: torch.Tensor, spec: ShiftedWindows) -> torch.Tensor:
    """One process: roll by -shift, pad at the end, cut row-major windows: ``(num_windows, area, C)``."""
    axes = len(spec.sizes)
    x = torch.roll(whole, tuple(-s for s in spec.shift), dims=tuple(range(axes)))
    pad: list[int] = [0, 0]
    for n, p in reversed(list(zip(spec.sizes, spec.padded))):
        pad += [0, p - n]
    x = torch.nn.functional.pad(x, pad)
    split = [d for c, w in zip(spec.counts, spec.window) for d in (c, w)]
    x = x.reshape(*split, x.shape[-1])
    order = [2 * a for a in range(axes)] + [2 * a + 1 for a in range(axes)] + [2 * axes]
    return x.permute(order).reshape(spec.num_windows, spec.area, x.shape[-1])


@pytest.mark.parametrize("shape,sizes", GRIDS)
def test_windows_gathered_on_tiles_are_one_process_windows_and_come_back(shape: tuple[int, ...],
                                                                         sizes: tuple[int, ...]) -> None:
    window = tuple(min(4, n) for n in sizes)
    spec = ShiftedWindows(sizes, window, tuple(w // 2 if n > w else 0 for w, n in zip(window, sizes)))
    layout = WindowLayout(spec, TokenBoxes(grid_of(shape), sizes))
    whole = torch.randn(*sizes, 3, dtype=torch.float64)
    gathered = simulate(layout.into_windows(), tiles_of(whole, layout.boxes))
    expected = reference_windows(whole, spec)
    for tile, buffer in enumerate(gathered):
        owned = layout.owned(tile)
        assert torch.equal(buffer.reshape(len(owned), spec.area, 3), expected[owned])
    back = simulate(layout.out_of_windows(), gathered)
    assert all(torch.equal(a, b) for a, b in zip(back, tiles_of(whole, layout.boxes)))
    assert sorted(w for t in range(layout.boxes.grid.num_tiles) for w in layout.owned(t)) == \
        list(range(spec.num_windows))


def reference_mask(spec: ShiftedWindows) -> torch.Tensor:
    """timm's Swin mask (2-D): labels painted by the three slices per axis, -100 where they differ."""
    image = torch.zeros(*spec.padded, 1)
    count = 0
    wh, ww = spec.window
    sh, sw = spec.shift
    for h in ((0, -wh), (-wh, -sh), (-sh, None)):
        for w in ((0, -ww), (-ww, -sw), (-sw, None)):
            image[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    labels = reference_windows(image, ShiftedWindows(spec.padded, spec.window, (0, 0)))[..., 0]
    diff = labels.unsqueeze(1) - labels.unsqueeze(2)
    return diff.masked_fill(diff != 0, MASK_VALUE)


@pytest.mark.parametrize("sizes,window,shift", [((14, 14), (7, 7), (3, 3)), ((13, 9), (4, 4), (2, 2)),
                                                ((8, 14), (8, 7), (0, 3))])
def test_mask_labels_give_timms_mask(sizes: tuple[int, int], window: tuple[int, int], shift: tuple[int, int]) -> None:
    spec = ShiftedWindows(sizes, window, shift)
    labels = torch.tensor([spec.labels(w) for w in range(spec.num_windows)], dtype=torch.float32)
    mask = (labels.unsqueeze(1) != labels.unsqueeze(2)).float() * MASK_VALUE
    assert torch.equal(mask, reference_mask(spec))


@pytest.mark.parametrize("shape,sizes", GRIDS)
def test_patch_merge_gathers_each_neighbourhood_in_timms_order(shape: tuple[int, ...], sizes: tuple[int, ...]) -> None:
    boxes = TokenBoxes(grid_of(shape), sizes)
    whole = torch.randn(*sizes, 2, dtype=torch.float64)
    merged = TokenBoxes(boxes.grid, tuple((n + 1) // 2 for n in sizes))
    got = simulate(plan_merge(boxes), tiles_of(whole, boxes))
    axes = len(sizes)
    pad: list[int] = [0, 0]
    for n in reversed(sizes):
        pad += [0, n % 2]
    x = torch.nn.functional.pad(whole, pad)
    split = [d for m in merged.sizes for d in (m, 2)]
    x = x.reshape(*split, 2)   # (m0, 2, m1, 2, [m2, 2,] C)
    order = [2 * a for a in range(axes)] + [2 * a + 1 for a in reversed(range(axes))] + [2 * axes]
    reference = x.permute(order).reshape(*merged.sizes, -1)   # timm: offsets of the first axis fastest
    for tile, part in zip(range(boxes.grid.num_tiles), tiles_of(reference, merged)):
        assert torch.equal(got[tile].reshape(part.shape[0], -1), part)


def test_windows_inside_tiles_move_nothing_and_a_straddling_window_goes_to_its_largest_part() -> None:
    inside = WindowLayout(ShiftedWindows((56, 56), (7, 7), (0, 0)), TokenBoxes(TileGrid(2, 2), (56, 56)))
    assert not inside.straddling() and all(plan.is_local for plan in inside.into_windows())
    last = WindowLayout(ShiftedWindows((7, 7), (7, 7), (0, 0)), TokenBoxes(TileGrid(2, 2), (7, 7)))
    assert last.owners == (0,) and last.straddling() == [0]   # tile 0 holds 4 x 4 of the 7 x 7 tokens
    plans = last.into_windows()
    assert plans[0].tokens_received == 49 - 16 and plans[3].tokens_sent == 9


def test_a_gather_names_each_token_where_it_lives() -> None:
    boxes = TokenBoxes(TileGrid(2, 2), (5, 5))
    for tile in range(4):
        for slot, coord in enumerate(boxes.coords(tile)):
            assert boxes.locate(coord) == (tile, slot)
    plans = plan_gather([[(4, 4)], [], [], [None]], boxes.locate, [boxes.count(t) for t in range(4)])
    assert plans[3].sends == ((0, (boxes.count(3) - 1,)),) and plans[3].size == 1 and not plans[3].own_targets


@pytest.mark.parametrize("pixels,bound", [(1024, 0.05), (896, 0.11)])
def test_a_shifted_block_of_swin_t_sends_little_of_its_tile(pixels: int, bound: float) -> None:
    """Swin-T stage 1 (patch 4, window 7, shift 3) at ``pixels``^2 on 2x2 tiles: the tokens a shifted block sends
    (into the windows and back) are at most ``bound`` of the tile's tokens (measured: 3.1% at 1024^2, where most
    windows at a seam lie on one side; 10.6% at 896^2, where the roll moves 3 rows and 3 columns). A block keeps at
    least 4*C values per token for backward (its MLP's hidden layer alone) and sends C per moved token, so at 1024^2
    its bytes sent are under 5% of its input and about 1% of its activations."""
    sizes = (pixels // 4, pixels // 4)
    layout = WindowLayout(ShiftedWindows(sizes, (7, 7), (3, 3)), TokenBoxes(TileGrid(2, 2), sizes))
    moved = [a.tokens_sent + b.tokens_sent for a, b in zip(layout.into_windows(), layout.out_of_windows())]
    tile_tokens = math.prod(sizes) // 4
    assert max(moved) <= bound * tile_tokens, (max(moved), tile_tokens)
