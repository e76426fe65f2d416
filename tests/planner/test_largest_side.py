"""planner.memory.largest_side: the largest side within a budget, in few calls of the peak."""

from __future__ import annotations

from mpi4dl_nb.planner.memory import largest_side


def _counted(peak):
    calls: list[int] = []

    def counted(side: int) -> int:
        calls.append(side)
        return peak(side)
    return counted, calls


def test_largest_side_is_the_last_multiple_within_the_budget_in_few_calls():
    for peak, budget, unit, want, most in (
            (lambda s: 100 + s * s, 10_000, 14, 98, 3),                     # affine in the area: interpolated
            (lambda s: 5e9 + 3000 * s * s + 2 * s ** 3, 80e9, 32, 2912, 12),   # bent: halving keeps it short
            (lambda s: 5e9 + 3000 * s * s, 4e9, 32, 0, 1)):                   # nothing fits
        counted, calls = _counted(peak)
        assert largest_side(counted, budget, unit) == want
        assert want == 0 or (peak(want) <= budget < peak(want + unit))
        assert len(calls) <= most, calls
        assert all(side % unit == 0 for side in calls)
