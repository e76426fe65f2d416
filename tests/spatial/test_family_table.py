"""The one table of conversions (spatial/families.py, issue 63): a toy global attention added as one ``Family`` entry
at run time, converted to its tile version with no change to convert.py, equal to one process on one tile here and,
under mpiexec, on 2x2 and 1x4 in float64 (tests/mpi/family_table.py, in the shared 4-rank launch); every entry
names an exactness program that exists; nothing under spatial/ registers itself by being imported; the guard's
handlers come from the op families' data; timm's classes resolve in one place, None where missing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mpi4dl_nb.comm.trace import Tracer
from mpi4dl_nb.spatial.families import (
    FAMILIES,
    OP_FAMILIES,
    Family,
    active_families,
    add_family,
    family_of,
    remove_family,
)
from mpi4dl_nb.spatial.family import timm_classes
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.guard import OpHandlers
from mpi4dl_nb.spatial.ops import OpKind
from tests.mpi.family_table import TOY, PixelAttention, TilePixelAttention, check_names
from tests.support.battery import shared_job
from tests.support.mpirun import REPO

SPATIAL = REPO / "mpi4dl_nb" / "spatial"
TABLE_JOB = shared_job(4, "family_table", timeout=300)


class OneRank:
    """A world of one process (no MPI): collectives are the identity."""

    rank, world_size = 0, 1
    tracer = Tracer(enabled=False)

    def all_reduce(self, t: torch.Tensor, group: object = None) -> torch.Tensor:
        return t


def _toy_model() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), PixelAttention(6, 2), nn.Conv2d(6, 2, 1)).double()


def test_a_family_added_at_run_time_converts_its_module_on_one_tile():
    from mpi4dl_nb.spatial.convert import spatialize

    model = _toy_model()
    net = spatialize(model, TileGrid(1, 1), OneRank(), families=(TOY, *FAMILIES))
    assert isinstance(net[2], TilePixelAttention) and isinstance(net[2], PixelAttention)
    x = torch.randn(2, 3, 5, 7, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(net(x), model(x), rtol=1e-12, atol=1e-12)


def test_add_family_asks_it_first_until_removed():
    assert active_families() == FAMILIES
    add_family(TOY)
    try:
        assert active_families() == (TOY, *FAMILIES)
    finally:
        remove_family(TOY)
    assert active_families() == FAMILIES


def test_the_toy_family_equals_one_process_on_tiles(shared_launch):
    shared_launch(TABLE_JOB).require(check_names())


@pytest.mark.parametrize("family", [*FAMILIES, TOY], ids=lambda family: family.name.split(" (")[0])
def test_every_entry_names_an_exactness_program_that_exists(family: Family):
    assert not Path(family.exactness).is_absolute() and (REPO / family.exactness).is_file(), family.exactness


def test_the_families_have_one_name_each_and_the_attention_ones_a_cost():
    names = [family.name for family in FAMILIES]
    assert len(set(names)) == len(names)
    costed = {family.name.split(" (")[0] for family in FAMILIES if family.cost is not None}
    assert costed == {"Swin", "ViT attention", "MaxViT partition attention", "EfficientViT linear attention"}


def test_the_list_only_names_records_each_family_module_declares():
    assert "Family(" not in (SPATIAL / "families.py").read_text()
    assert len(set(FAMILIES)) == len(FAMILIES) and all(isinstance(family, Family) for family in FAMILIES)


def test_nothing_under_spatial_registers_by_being_imported():
    """No import kept for its side effects, no registration call at a module's top level."""
    kept = [f"{path.relative_to(REPO)}:{n}" for path in sorted(SPATIAL.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if "noqa: F401" in line]
    assert kept == []
    top_level_calls = re.compile(r"^(register_\w+|\w+\.register_\w+|SPATIAL_LAYERS\[)", re.MULTILINE)
    assert [str(path.relative_to(REPO)) for path in sorted(SPATIAL.rglob("*.py"))
            if top_level_calls.search(path.read_text())] == []


def test_the_guard_asks_the_op_families_handlers_in_the_table_order():
    handlers = OpHandlers.of(OP_FAMILIES)
    assert [h.__module__.rsplit(".", 1)[1] for h in handlers.tiled[OpKind.WINDOW]] == ["reductions", "pool_calls"]
    assert [h.__module__.rsplit(".", 1)[1] for h in handlers.tiled[OpKind.DIMS]] == ["reductions", "relayout"]
    assert set(handlers.untiled) == {OpKind.DROPOUT, OpKind.RANDOM, OpKind.RESAMPLE}
    assert set(handlers.volume) == {OpKind.DROPOUT, OpKind.RANDOM, OpKind.CHANNEL, OpKind.NORM}
    assert len(handlers.layout) == 1 and [kind for kind in handlers.ops.values()] == [OpKind.POOLING]


def test_timm_classes_resolve_in_one_place_and_are_none_where_missing():
    assert timm_classes(("timm.no_such_module.Attention", "torch.nn.NoSuchLayer", "torch.nn.Conv2d")) == (nn.Conv2d,)
    pytest.importorskip("timm")
    from timm.layers.attention import Attention

    timm_paths = [path for family in FAMILIES for path in family.timm]
    assert Attention in timm_classes(tuple(timm_paths)) and len(timm_paths) > 15
    assert [path for path in timm_paths if not timm_classes((path,))] == []


def test_spatial_imports_no_model():
    assert [str(path.relative_to(REPO)) for path in sorted(SPATIAL.rglob("*.py"))
            if re.search(r"^from \.\.+models|^import mpi4dl_nb\.models", path.read_text(), re.MULTILINE)] == []



def test_family_of_names_the_entry_that_converts_a_module():
    assert family_of(nn.Conv2d(1, 1, 1)).name.startswith("torch layers")
    assert family_of(nn.ReLU()).name.startswith("element-wise")
    assert family_of(PixelAttention(4, 1)) is None and family_of(PixelAttention(4, 1), (TOY, *FAMILIES)) is TOY
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1)
    assert family_of(vit.blocks[0].attn).cost is not None and family_of(vit).name.startswith("ViT token model")
    assert family_of(vit.patch_embed).name.endswith("outside one: refused)")
