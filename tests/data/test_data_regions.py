"""Under mpiexec, spatial ranks read only their tile box of each whole-slide tile (tests/mpi/models_regions.py)."""
from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb.data import ihc_image
from tests.mpi.models_regions import LOSS, READS
from tests.support.pyramid import write_pyramid

tifffile = pytest.importorskip("tifffile")


def test_spatial_ranks_read_only_their_region(mpirun, tmp_path):
    image = np.full((512, 512, 3), 255, np.uint8)
    image[:256, :384] = ihc_image()[:256, :384]
    path = tmp_path / "slide.tif"
    write_pyramid(path, image)
    result = mpirun(5, "models_regions", str(path), timeout=300, checks=[READS, LOSS])
    assert {r.rank for r in result.checks.results} == set(range(5))   # every rank checked itself
