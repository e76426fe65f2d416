"""The guard's refusal rules for an image's tiles and a volume's (one set, what differs as data), and the note on a
model's own error on a tile."""

from __future__ import annotations

import torch
from torch import nn

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.spatial.guard import PASSING_ON
from mpi4dl_nb.spatial.guard_frames import TILE_FAILURE, tile_failure_note
from mpi4dl_nb.spatial.guard_rules import IMAGE, VOLUME
from mpi4dl_nb.spatial.ops import OpKind, kind_of
from mpi4dl_nb.spatial.tile_marks import mark_tiled


def refusal(rules, func, *args):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return rules.refusal(kind_of(func), func, args, {}, tensors)


def test_shared_rules_name_what_the_tiles_split_and_read_its_tiled_dims():
    image_tile = mark_tiled(torch.zeros(1, 2, 4, 4, dtype=torch.float64))
    volume_tile = mark_tiled(torch.zeros(1, 2, 3, 4, 4, dtype=torch.float64))
    for rules, tile, whole in ((IMAGE, image_tile, "image"), (VOLUME, volume_tile, "volume")):
        replicated = torch.zeros(tile.shape, dtype=torch.float64)
        assert refusal(rules, torch.Tensor.add_, replicated, tile).endswith(f"one not split like the {whole})")
        assert refusal(rules, torch.add, tile, torch.ones(1, 2, *[1] * len(rules.offsets))) is None
        assert "varies along the spatial dimensions" in refusal(rules, torch.add, tile, replicated)
    per_depth = torch.ones(1, 2, 3, 1, 1, dtype=torch.float64)   # varies along depth only: a tiled dim of a volume
    assert refusal(IMAGE, torch.add, mark_tiled(torch.zeros(1, 2, 3, 4, 4)), per_depth) is None
    assert refusal(VOLUME, torch.add, volume_tile, per_depth) is not None


def test_each_grid_keeps_its_own_rules_for_the_other_kinds():
    tile = mark_tiled(torch.zeros(1, 2, 4, 4))
    assert kind_of(torch.Tensor.view) is OpKind.SHAPE and kind_of(torch.rand_like) is OpKind.RANDOM
    assert kind_of(torch.fft.fft2) is None and kind_of(torch.unique) is OpKind.REFUSED
    assert "register_op" in refusal(IMAGE, torch.fft.fft2, tile)
    assert refusal(IMAGE, torch.unique, tile) == "the result depends on one tile's values"   # ops.py's hint
    assert "not known to be exact on a volume's tiles" in refusal(VOLUME, torch.fft.fft2, tile)
    assert "draws random numbers for one tile" in refusal(IMAGE, torch.rand_like, tile)
    assert "not known to be exact on a volume's tiles" in refusal(VOLUME, torch.rand_like, tile)
    assert refusal(VOLUME, torch.Tensor.view, tile, -1) is None   # a view: checked on its outputs
    assert IMAGE.tile_dims and IMAGE.reshape_refused and not (VOLUME.tile_dims or VOLUME.reshape_refused)


class Checked(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] == 8, "expects the whole image"
        return x


def test_a_model_s_own_error_gets_a_note_naming_its_module_once():
    module = Checked()
    try:
        module(torch.zeros(1, 4))
    except AssertionError as error:
        note = tile_failure_note(error, {id(module): "3.check"}, PASSING_ON)
        assert note is not None and note.startswith(f"{TILE_FAILURE} layer '3.check' (Checked)")
        error.add_note(note)
        assert tile_failure_note(error, {id(module): "3.check"}, PASSING_ON) is None   # noted once
        assert tile_failure_note(error, {}, PASSING_ON) is None   # no module of this model
    assert tile_failure_note(ConfigError("model", "refused"), {id(module): ""}, PASSING_ON) is None
