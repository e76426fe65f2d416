"""A family is one record (issue 78): a toy attention family added as one record at run time, in a model that models/
cuts into pieces, spatializes exactly (one tile here; 2x2 and 1x4 in float64 under mpiexec, tests/mpi/family_record.py
in the shared 4-rank launch); models/ names the records that convert its modules (``tile_family``) and inherits no
class of spatial/ (read from the source: every class's bases); each record's conversion trusts its match.
"""

from __future__ import annotations

import ast

import pytest
import torch
from torch import nn

from mpi4dl_nb.models.cut import layer_list
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.families import FAMILIES, active_families, add_family, family_of, remove_family
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi.family_record import AttendingNet, check_names, cut
from tests.mpi.family_table import TOY, TilePixelAttention
from tests.spatial.test_family_table import OneRank
from tests.support.battery import shared_job
from tests.support.mpirun import REPO

PACKAGE = REPO / "mpi4dl_nb"
RECORD_JOB = shared_job(4, "family_record", timeout=300)


def test_a_family_added_as_one_record_converts_a_model_cut_by_models_on_one_tile():
    torch.manual_seed(3)
    model = AttendingNet().double()
    pieces = cut(model)
    add_family(TOY)
    try:
        net = spatialize(pieces, TileGrid(1, 1), OneRank())
    finally:
        remove_family(TOY)
    assert active_families() == FAMILIES
    assert any(isinstance(m, TilePixelAttention) for m in net.modules())
    x = torch.randn(2, 3, 6, 9, dtype=torch.float64, requires_grad=True)
    expected = model(x)
    torch.testing.assert_close(net(x), expected, rtol=1e-12, atol=1e-12)


def test_the_toy_family_in_a_cut_model_equals_one_process_on_tiles(shared_launch):
    shared_launch(RECORD_JOB).require(check_names())


def _spatial_classes() -> dict[str, set[str]]:
    """Every spatial module's dotted name -> the classes it defines."""
    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "spatial").rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found[name] = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    return found


def _imported(node: ast.ImportFrom, module: str) -> str:
    """The absolute module a ``from ... import`` of ``module`` reads."""
    if not node.level:
        return node.module or ""
    base = module.split(".")[:-node.level]
    return ".".join([*base, *([node.module] if node.module else [])])


def inherited_spatial_classes(module: str, source: str, spatial: dict[str, set[str]]) -> list[str]:
    """``class X(Base)`` of ``source`` (the module ``module``) whose base is a class defined in spatial/."""
    names: dict[str, tuple[str, str]] = {}    # a local name -> (spatial module, class) or (spatial module, "")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            origin = _imported(node, module)
            for alias in node.names:
                if f"{origin}.{alias.name}" in spatial:     # a module of spatial/
                    names[alias.asname or alias.name] = (f"{origin}.{alias.name}", "")
                elif origin in spatial:
                    names[alias.asname or alias.name] = (origin, alias.name)
    found = []
    for node in ast.walk(tree):
        for base in node.bases if isinstance(node, ast.ClassDef) else []:
            if isinstance(base, ast.Name) and base.id in names:
                origin, name = names[base.id]
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in names:
                origin, name = names[base.value.id][0], base.attr
            else:
                continue
            if name in spatial[origin]:
                found.append(f"{module}.{node.name}({origin}.{name})")
    return found


def test_no_model_class_inherits_a_class_of_spatial():
    spatial = _spatial_classes()
    found = [hit for path in sorted((PACKAGE / "models").rglob("*.py"))
             for hit in inherited_spatial_classes(".".join(path.relative_to(REPO).with_suffix("").parts),
                                                  path.read_text(), spatial)]
    assert found == []
    made_up = "from ..spatial.layer import SpatialLayer\nfrom ..spatial import layer\n" \
              "class A(SpatialLayer): pass\nclass B(layer.SpatialRuntime): pass\nclass C(nn.Module): pass\n"
    assert inherited_spatial_classes("mpi4dl_nb.models.x", made_up, spatial) == [
        "mpi4dl_nb.models.x.A(mpi4dl_nb.spatial.layer.SpatialLayer)",
        "mpi4dl_nb.models.x.B(mpi4dl_nb.spatial.layer.SpatialRuntime)"]


def test_models_name_the_records_that_convert_their_pieces_and_layers():
    from mpi4dl_nb.models.swin3d import PatchMerging3d, SwinBlock3d

    block, merge = SwinBlock3d(8, 2, (2, 2, 2), shifted=True), PatchMerging3d(8)
    assert family_of(block) is SwinBlock3d.tile_family and family_of(merge) is PatchMerging3d.tile_family
    assert family_of(block).name.startswith("3-D Swin") and family_of(merge) is not family_of(block)

    class OwnForward(SwinBlock3d):   # a subclass not naming the record itself keeps its own forward
        pass

    assert family_of(OwnForward(8, 2, (2, 2, 2), shifted=False)) is None
    assert all(family in FAMILIES for family in (SwinBlock3d.tile_family, PatchMerging3d.tile_family))


def test_a_cut_vit_names_its_records_and_a_timm_record_its_classes():
    timm = pytest.importorskip("timm")
    from mpi4dl_nb.models.vit import RopeBlock, TokenEmbedding

    pieces = layer_list(timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1), check=False)
    assert family_of(pieces[0]) is TokenEmbedding.tile_family and family_of(pieces[1]) is None   # a plain block
    assert RopeBlock.tile_family in FAMILIES and RopeBlock.tile_family is not TokenEmbedding.tile_family
    partition = [family for family in FAMILIES if family.name.startswith("MaxViT")]
    assert [family.timm for family in partition] == [("timm.models.maxxvit.PartitionAttentionCl",),
                                                      ("timm.models.maxxvit.PartitionAttention2d",)]


def test_each_swin_record_converts_or_refuses_what_it_matches_alone():
    timm = pytest.importorskip("timm")
    from mpi4dl_nb.config import ConfigError

    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1, 1, 1))
    block, merge = swin.layers[0].blocks[0], swin.layers[1].downsample
    names = [family_of(module).name for module in (swin, block, merge)]
    assert len(set(names)) == 3 and all(name.startswith("Swin (") for name in names)
    for module in (block, merge):
        with pytest.raises(ConfigError, match="exact on tiles inside timm's SwinTransformer"):
            spatialize(nn.Sequential(module), TileGrid(1, 1), OneRank())
