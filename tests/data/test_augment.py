"""data/augment.py: a tile of the augmented image equals the augmented tile; draws keyed by (seed, epoch, step,
image)."""
from __future__ import annotations

import itertools

import pytest
import torch

from mpi4dl_nb.data import Batcher, SyntheticDataset
from mpi4dl_nb.data.augment import AugmentKind, AugmentSpec, Draw
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.spatial.geometry import TileGrid

EVERY = AugmentSpec.parse("flip,rot90,color,hed")
JITTER = dict(brightness=1.15, contrast=0.85, saturation=1.2, stain_scale=(1.04, 0.96, 1.02),
              stain_shift=(0.03, -0.02, 0.01), recolour=True, stain=True)


@pytest.mark.parametrize("hflip,vflip,turns", list(itertools.product([False, True], [False, True], range(4))))
def test_a_box_read_through_the_draw_equals_that_box_of_the_augmented_image(hflip, vflip, turns):
    size = 11
    image = torch.rand(3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(turns))
    draw = Draw(hflip=hflip, vflip=vflip, turns=turns, **JITTER)
    whole = draw.apply(image)
    corners = torch.randint(0, size + 1, (40, 4), generator=torch.Generator().manual_seed(7)).tolist()
    boxes = [(min(a, b), max(a, b), min(c, d), max(c, d)) for a, b, c, d in corners if a != b and c != d]
    for r0, r1, c0, c1 in boxes + [(0, size, 0, size), (3, 4, 0, 1)]:
        s0, s1, t0, t1 = draw.source_box((r0, r1, c0, c1), size)
        assert 0 <= s0 < s1 <= size and 0 <= t0 < t1 <= size
        part = draw.apply(image[:, s0:s1, t0:t1])
        assert torch.equal(part, whole[:, r0:r1, c0:c1]), (r0, r1, c0, c1)


def test_batches_cut_into_tiles_equal_the_whole_augmented_batch():
    dataset = SyntheticDataset(12, 3, 8, seed=1)
    batcher = Batcher(dataset, 4, seed=5, augment=EVERY)
    grid = TileGrid(2, 2)
    for epoch, step in [(0, 0), (0, 1), (1, 0)]:
        whole = batcher.images(epoch, step)
        tiles = [batcher.images(epoch, step, grid.tile_box(t, 12, 12)) for t in range(4)]
        joined = torch.cat([torch.cat(tiles[:2], dim=-1), torch.cat(tiles[2:], dim=-1)], dim=-2)
        assert torch.equal(joined, whole)
    plain = Batcher(dataset, 4, seed=5)
    assert not torch.equal(plain.images(0, 0), batcher.images(0, 0))      # augmentation does something
    assert plain.augmentation(0, 0, 3) is None


def test_draws_are_keyed_by_seed_epoch_step_and_image_alone():
    draw = EVERY.draw(3, 1, 2, 5)
    assert EVERY.draw(3, 1, 2, 5) == draw
    assert len({EVERY.draw(*key) for key in [(3, 1, 2, 5), (4, 1, 2, 5), (3, 0, 2, 5), (3, 1, 1, 5),
                                              (3, 1, 2, 6)]}) == 5
    geometric = AugmentSpec.parse("flip,rot90").draw(3, 1, 2, 5)    # enabling colour leaves the flips alone
    assert (geometric.hflip, geometric.vflip, geometric.turns) == (draw.hflip, draw.vflip, draw.turns)
    assert not geometric.recolour and geometric.brightness == 1.0
    turns = {EVERY.draw(0, 0, 0, i).turns for i in range(64)}
    flips = {(EVERY.draw(0, 0, 0, i).hflip, EVERY.draw(0, 0, 0, i).vflip) for i in range(64)}
    assert turns == {0, 1, 2, 3} and len(flips) == 4
    factors = [EVERY.draw(0, 0, 0, i).brightness for i in range(64)]
    assert 0.8 <= min(factors) < 0.9 and 1.1 < max(factors) <= 1.2


def test_colour_changes_act_per_pixel_and_zero_stain_jitter_is_the_identity():
    image = torch.rand(3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.9 + 0.05
    still = Draw(stain=True)
    assert torch.allclose(still.recoloured(image), image, atol=1e-12)
    brighter = Draw(brightness=1.1, recolour=True).recoloured(image)
    assert torch.allclose(brighter, (image * 1.1).clamp(0, 1), atol=1e-15)
    grey = Draw(saturation=0.0, recolour=True).recoloured(image)
    assert torch.allclose(grey[0], grey[1]) and torch.allclose(grey[1], grey[2])
    jittered = Draw(**JITTER).recoloured(image.float())
    assert jittered.dtype == torch.float32 and 0 <= jittered.min() and jittered.max() <= 1


def test_parsing_checking_and_recording():
    assert AugmentSpec.parse("hed, flip").kinds == {AugmentKind.HED, AugmentKind.FLIP}
    assert AugmentSpec.parse("hed,flip").describe() == "flip,hed"
    assert not AugmentSpec.parse(None) and not AugmentSpec.parse("none")
    assert AugmentSpec.parse("none").describe() == "none"
    with pytest.raises(ConfigError, match="--augment.*rot45.*flip,rot90,color,hed"):
        AugmentSpec.parse("flip,rot45")
    assert AugmentSpec.from_dict(EVERY.to_dict()) == EVERY
    with pytest.raises(ConfigError, match="4 channels"):
        EVERY.check_channels(4)
    AugmentSpec.parse("flip,rot90").check_channels(1)     # flips and turns need no colours
