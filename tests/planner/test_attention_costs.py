"""The planner costs windowed and global attention through the conversion families (``spatial.families``): issue 63.

``layout --cost`` and ``suggest`` for a MaxViT (timm's smallest ``_rw_`` one, 256 px) and a Swin (Swin-T's geometry
at 224 px), one block a stage (``--model-args depths=(1,1,1,1)``: the same block code, a quarter of the planning):
their costs are present and positive, and the spatial stage's attention exchanges (``planner/exchanges.py``, each
module costed by its family's ``cost``) are counted: MaxViT's partition moves on its spatial stage, Swin's window
gathers growing with the tiles. A Swin cut by ``layer_list`` runs on tiles only whole (the Swin family converts whole
models), so its spatial configurations are refused with the family's reason and its layer-parallel ones costed.
About 15 CPU-s (the memo of shape-only probes, ``pipeline/layer_memo.py``, spares ``suggest`` most scans).
"""

from __future__ import annotations

import re

import pytest

from tests.planner.attention_models import MAXVIT, SWIN, tiny_swin
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

GiB = 2**30
ONE_BLOCK_A_STAGE = "depths=(1,1,1,1)"   # the same block code as at full depth, a quarter of the planning


@pytest.fixture(autouse=True)
def _timm() -> None:
    require_or_skip(missing_modules("timm"), "timm's Swin and MaxViT", MODELS_EXTRA)


def layout(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    from mpi4dl_nb.cli import layout_cmd

    code = layout_cmd.main(["--cost", "--num-classes", "10", *flags])
    shown = capsys.readouterr()
    assert code == 0 and "Traceback" not in shown.err, shown.err
    return shown.out


def sent_mib(shown: str) -> float:
    found = re.search(r"forward ([0-9.]+) MiB sent", shown)
    assert found, shown
    return float(found.group(1))


def peak_mib(shown: str) -> float:
    found = re.search(r"cost \(planner, batch 1\): peak ([0-9.]+) MiB", shown)
    assert found, shown
    return float(found.group(1))


def test_layout_costs_a_maxvit_configuration_with_its_partition_exchanges(capsys):
    shown = layout(capsys, "--model", f"timm:{MAXVIT}", "--model-args", ONE_BLOCK_A_STAGE, "--image-size", "256",
                   "--split-size", "2",
                   "--spatial-size", "1", "--num-spatial-parts", "4")
    assert peak_mib(shown) > 0 and "MaxViT partition attention" in shown and sent_mib(shown) > 0


def test_layout_costs_a_swin_and_its_window_exchanges_grow_with_the_tiles(capsys):
    swin = ("--model", f"timm:{SWIN}", "--model-args", ONE_BLOCK_A_STAGE, "--image-size", "224", "--split-size", "2")
    cut = layout(capsys, *swin, "--spatial-size", "0")
    assert peak_mib(cut) > 0 and "attention exchanges" not in cut     # layer-parallel: nothing on tiles
    tiled = layout(capsys, *swin, "--spatial-size", "1", "--num-spatial-parts", "4")
    # timm's Swin cut at its stages (models/swin.py): each tiled stage's windows exchanged across the 2x2 tiles, costed
    assert peak_mib(tiled) > 0 and sent_mib(tiled) > 0 and re.search(r"\d attention exchanges? \(Swin\)", tiled)
    whole = "tests.planner.attention_models:tiny_swin"    # the whole model on tiles: its own tile version
    sent = [sent_mib(layout(capsys, "--model", whole, "--image-size", "224", "--split-size", "1", "--spatial-size",
                            "1", "--balance", "1", "--num-spatial-parts", str(parts), "--slice-method", method))
            for parts, method in ((2, "vertical"), (4, "square"), (8, "vertical"))]
    assert 0 < sent[0] < sent[1] < sent[2]


def test_stage_exchanges_count_every_family_module():
    import timm
    import torch

    from mpi4dl_nb.models.cut import layer_list
    from mpi4dl_nb.planner.exchanges import stage_exchanges
    from mpi4dl_nb.spatial.geometry import TileGrid
    from mpi4dl_nb.spatial.windows.traffic import swin_cost

    torch.manual_seed(0)
    swin = tiny_swin()
    found = stage_exchanges(swin, TileGrid(2, 2), 224)
    assert [(e.path, e.sizes) for e in found.exchanges] == [("0", (224, 224))]
    assert found.exchanges[0].traffic == swin_cost(swin[0], TileGrid(2, 2), (224, 224), 4)
    vit = layer_list(timm.create_model("vit_tiny_patch16_224", num_classes=10, depth=2), check=False)
    rings = stage_exchanges(vit[:-1], TileGrid(2, 2), 224)
    assert [(e.path, e.sizes) for e in rings.exchanges] == [("1.blocks.0.attn", (14, 14)),
                                                            ("2.blocks.1.attn", (14, 14))]
    assert rings.sent > 0 and rings.describe().startswith("2 attention exchanges (ViT attention)")


def test_suggest_costs_maxvit_and_swin_configurations():
    import timm
    import torch

    from mpi4dl_nb.models.cut import layer_list
    from mpi4dl_nb.planner.suggest import suggest

    torch.manual_seed(0)
    maxvit = layer_list(timm.create_model(MAXVIT, num_classes=10, depths=(1, 1, 1, 1),   # a block a stage
                                          drop_path_rate=0.0))   # replicas drawing masks: refused (stage_draws)
    found = suggest(maxvit, 256, 4 * GiB, 3, max_split=2, device="cpu")
    assert found and all(s.peak_bytes > 0 and s.est_step_time > 0 for s in found)
    tiled = [s for s in found if s.cfg.spatial_size]
    assert tiled and all(s.exchanges is not None and s.exchanges.sent > 0 for s in tiled)
    assert "attention exchanges" in found.table()
    swin = layer_list(timm.create_model(SWIN, num_classes=10, depths=(1, 1, 1, 1), embed_dim=32,
                                        num_heads=(1, 2, 4, 8)))
    with pytest.raises(ValueError, match="stochastic depth on two stages or on replicas are left out"):
        suggest(swin, 224, 4 * GiB, 2, max_split=1, device="cpu")    # timm's drop path 0.1: replicas refused
    swin = layer_list(timm.create_model(SWIN, num_classes=10, depths=(1, 1, 1, 1), embed_dim=32,
                                        num_heads=(1, 2, 4, 8), drop_path_rate=0.0))
    found = suggest(swin, 224, 4 * GiB, 2, max_split=2, device="cpu")
    assert found and all(s.peak_bytes > 0 and s.est_step_time > 0 and s.cfg.spatial_size == 0 for s in found)
