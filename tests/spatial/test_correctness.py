"""No silent wrong answer on tiles (issue 10): new exact layers, SE gates, U-Net, refused
functional ops, a per-pixel loss on tiles and 200 random CNNs, on grids 2x2, 1x4, 3x1, 3x3.

Every check of a grid runs in one job (tests/mpi/spatial_correctness.py), in the shared launch of
its world size (tests/support/battery.py); each check is its own test. A failing fuzz case prints
its seed and a replay command.
"""

from __future__ import annotations

import pytest

from tests.mpi.spatial_correctness import check_names
from tests.support.battery import shared_job

FUZZ = {(2, 2): 60, (1, 4): 50, (3, 1): 60, (3, 3): 30}   # 200 random models in all
GRIDS = list(FUZZ)
JOBS = {(rows, cols): shared_job(rows * cols, "spatial_correctness", rows, cols, f"--fuzz={fuzz}", timeout=900)
        for (rows, cols), fuzz in FUZZ.items()}


@pytest.mark.parametrize("rows,cols", GRIDS, ids=[f"{r}x{c}" for r, c in GRIDS])
def test_exact_or_refused(shared_launch, rows, cols):
    names = check_names(rows, cols, FUZZ[(rows, cols)])
    assert sum(name.startswith("fuzz") for name in names) == FUZZ[(rows, cols)]
    shared_launch(JOBS[(rows, cols)]).require(names)


def test_two_hundred_fuzz_cases():
    assert sum(FUZZ.values()) == 200
