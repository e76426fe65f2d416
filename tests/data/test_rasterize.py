"""Polygons to pixels: even-odd filling equals a point-in-polygon test at every pixel centre, the same for any box."""

import numpy as np
import pytest
from matplotlib.path import Path as MPath

from mpi4dl_nb.data.rasterize import fill, label_map


def star(seed: int = 0, points: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    angle = np.sort(rng.uniform(0, 2 * np.pi, points))
    radius = rng.uniform(10, 30, points)
    return np.stack([50.3 + radius * np.cos(angle), 40.2 + radius * np.sin(angle)], 1)


HOLE = np.array([[45.3, 35.1], [55.3, 35.1], [55.3, 45.1], [45.3, 45.1]])


def brute_force(rings, height, width, downsample=1.0):
    yy, xx = np.mgrid[0:height, 0:width]
    centres = np.stack([(xx.ravel() + 0.5) * downsample, (yy.ravel() + 0.5) * downsample], 1)
    inside = np.zeros(len(centres), bool)
    for ring in rings:
        inside ^= MPath(np.vstack([ring, ring[:1]])).contains_points(centres)
    return inside.reshape(height, width)


@pytest.mark.parametrize("downsample", [1.0, 2.0, 3.0])
def test_fill_is_the_even_odd_rule_at_pixel_centres(downsample):
    rings = [star(), HOLE]
    height, width = int(90 / downsample), int(100 / downsample)
    got = fill(rings, (0, height, 0, width), downsample)
    assert got.any() and np.array_equal(got, brute_force(rings, height, width, downsample))


def test_any_box_equals_the_same_box_cut_from_the_whole_level():
    rings = [star(3, 200), HOLE]
    whole = fill(rings, (0, 90, 0, 100))
    for r0, r1, c0, c1 in [(10, 37, 5, 63), (33, 34, 0, 100), (0, 90, 51, 52), (80, 90, 90, 100), (0, 1, 0, 1)]:
        assert np.array_equal(fill(rings, (r0, r1, c0, c1)), whole[r0:r1, c0:c1])
    tiles = np.block([[fill(rings, (r, r + 45, c, c + 50)) for c in (0, 50)] for r in (0, 45)])
    assert np.array_equal(tiles, whole)


def test_label_map_draws_classes_in_order_and_leaves_background():
    square = [np.array([[10.0, 10.0], [30.0, 10.0], [30.0, 30.0], [10.0, 30.0]])]
    inner = [np.array([[20.0, 20.0], [40.0, 20.0], [40.0, 40.0], [20.0, 40.0]])]
    far = [np.array([[500.0, 500.0], [510.0, 500.0], [505.0, 510.0]])]
    labels = label_map([[], [square, far], [inner]], (0, 50, 0, 50), background=0)
    assert labels[15, 15] == 1 and labels[25, 25] == 2 and labels[35, 35] == 2 and labels[5, 5] == 0
    assert labels.dtype == np.int64 and set(np.unique(labels)) == {0, 1, 2}
    assert (labels == 1).sum() == 20 * 20 - 10 * 10
