"""The slide-level pools (issue 43) on tiles: max (ties included), attention-MIL and tissue-mean heads exact against
one process on 2x2, 1x4 and 3x1 grids of uneven tiles (tests/mpi/mil_pool.py, in the shared launches); one process:
``softmax_pool`` is the softmax-weighted sum, the max pool's tie goes to the first maximum."""

from __future__ import annotations

import pytest
import torch

from mpi4dl_nb.models.pools import AttentionMILPool, GlobalMaxPool, TissueMeanPool
from mpi4dl_nb.spatial.mil_pool import softmax_pool
from tests.mpi.mil_pool import check_names
from tests.support.battery import shared_job

GRIDS = [(2, 2), (1, 4), (3, 1)]
JOBS = {(rows, cols): shared_job(rows * cols, "mil_pool", rows, cols, timeout=300) for rows, cols in GRIDS}


@pytest.mark.parametrize("rows,cols", GRIDS, ids=[f"{r}x{c}" for r, c in GRIDS])
def test_pools_on_tiles_equal_one_process(shared_launch, rows, cols):
    shared_launch(JOBS[(rows, cols)]).require(check_names())


def test_softmax_pool_is_the_attention_weighted_sum():
    h = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    scores = torch.randn(2, 1, 4, 5, dtype=torch.float64)
    weights = torch.softmax(scores.reshape(2, -1), 1)
    want = torch.einsum("np,ncp->nc", weights, h.reshape(2, 3, -1))
    torch.testing.assert_close(softmax_pool(h, scores), want, rtol=1e-12, atol=0)


def test_attention_pool_of_equal_scores_is_the_mean():
    pool = AttentionMILPool(3, 2).double()
    torch.nn.init.zeros_(pool.w.weight)
    h = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(pool(h), h.mean((2, 3)), rtol=1e-12, atol=1e-15)


def test_max_pool_gives_the_gradient_to_the_first_maximum_only():
    x = torch.zeros(1, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        x[0, 0, 1, 2] = x[0, 0, 2, 0] = 1.0
    GlobalMaxPool()(x).sum().backward()
    assert x.grad is not None
    assert x.grad.flatten().tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0]


def test_tissue_mean_averages_the_marked_positions_only():
    features = torch.arange(8, dtype=torch.float64).reshape(1, 2, 2, 2)
    tissue = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)
    pooled = TissueMeanPool()(torch.cat([features, tissue], 1))
    assert pooled.tolist() == [[1.5, 5.5]]
    assert TissueMeanPool()(torch.cat([features, 0 * tissue], 1)).tolist() == [[0.0, 0.0]]
