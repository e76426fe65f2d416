"""The whole-slide memory benchmark's search (benchmarks/support/whole_slide.py) finds the largest canvas side
within a budget from measurements alone, on peaks shaped as measured ones are (a flat floor, then linear in the
pixels); and the canvas multiples and layouts it searches on."""

from __future__ import annotations

import pytest

from benchmarks.support.whole_slide import canvas_multiple, largest_side, processes, whole_slide_config

MIB = 2 ** 20


def peaks(floor: float, fixed: float, per_pixel: float, ranks: int = 2):
    """A measure function: every rank's peak max(floor, fixed + per_pixel x side^2) (the last rank smaller, as the
    layer rank is), and the sides it was asked for."""
    asked: list[int] = []

    def measure(side: int) -> list[int]:
        asked.append(side)
        peak = int(max(floor, fixed + per_pixel * side * side))
        return [peak] * (ranks - 1) + [peak // 10]

    return measure, asked


@pytest.mark.parametrize("multiple, start", [(32, 256), (64, 128), (128, 256)])
def test_the_largest_fitting_side_and_both_sides_of_it_are_measured(multiple, start):
    budget = 256 * MIB
    measure, asked = peaks(floor=175 * MIB, fixed=135 * MIB, per_pixel=415.0)
    found = largest_side(budget, multiple, start, measure)
    exact = max(s for s in range(multiple, 4096, multiple) if 135 * MIB + 415.0 * s * s <= budget)
    assert found.side == exact and found.too_big == exact + multiple
    assert {exact, exact + multiple} <= set(asked) and found.measured == len(set(asked)) <= 8
    assert max(found.peaks) <= budget and all(s % multiple == 0 for s in asked)


def test_a_first_side_over_the_budget_is_refused_naming_the_fix():
    measure, _ = peaks(floor=300 * MIB, fixed=0, per_pixel=0)
    with pytest.raises(SystemExit, match="raise the budget or start smaller"):
        largest_side(256 * MIB, 32, 256, measure)


def test_layouts_and_multiples():
    assert [processes(t) for t in (1, 4, 8)] == [1, 5, 9]
    assert [canvas_multiple(t, 32) for t in (1, 4, 8)] == [32, 64, 128]   # 2x4 tiles: rows 64, columns 128
    config = whole_slide_config(8, 10, recompute=True, bf16=True)
    assert config.grid_shape == (2, 4) and config.balance == (9, 1) and config.world_size == 9
    assert whole_slide_config(1, 10).world_size == 1
