"""The attention viewer: who holds which token, whose keys arrive at which ring step, a query's map over the image
(found by artist gid, drawn with Agg), a timm ViT's weights, the widget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpi4dl_nb import viz
from mpi4dl_nb.notebook.attention_view import (
    Arrival,
    RingTokens,
    draw_query_attention,
    draw_ring_arrivals,
    query_label,
    vit_attention,
    vit_token_grid,
)
from mpi4dl_nb.planner.attention import TokenGrid
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

TILES = RingTokens(TokenGrid(5, 6, prefix=2), TileGrid(2, 2))     # rows 3 + 2, cols 3 + 3; class + a register


def test_tokens_belong_to_their_tile_and_the_prefix_to_member_0():
    owners = TILES.owners()
    assert owners.tolist() == [[0, 0, 0, 1, 1, 1]] * 3 + [[2, 2, 2, 3, 3, 3]] * 2
    assert [TILES.owner(q) for q in (0, 1, 2, 2 + 5, 2 + 3 * 6, 2 + 29)] == [0, 0, 0, 1, 2, 3]
    assert TILES.position(1) is None and TILES.position(2 + 6 + 4) == (1, 4)
    assert TILES.member_keys(0) == [0, 1, 2, 3, 4, 8, 9, 10, 14, 15, 16]
    order = TILES.ring_order()
    assert sorted(order) == list(range(32)) and order[:2] == [0, 1]          # member 0's keys first
    assert [len(TILES.member_keys(m)) for m in range(4)] == [11, 9, 6, 6]
    assert query_label(TILES, 0) == "class token" and query_label(TILES, 8) == "token (1, 0)"
    with pytest.raises(ValueError, match="tokens 0 .. 31"):
        TILES.owner(32)


def test_arrivals_follow_the_ring_own_keys_first_then_the_predecessors():
    assert TILES.arrivals(2 + 29) == [Arrival(0, 3, 6), Arrival(1, 2, 6), Arrival(2, 1, 9), Arrival(3, 0, 11)]
    for query in range(32):
        owners = [a.owner for a in TILES.arrivals(query)]
        assert owners[0] == TILES.owner(query) and sorted(owners) == [0, 1, 2, 3]


def test_weights_map_onto_the_grid_and_each_member_s_share_adds_up():
    weights = np.arange(32, dtype=float)
    grid_map, prefix = TILES.grid_map(weights)
    assert prefix.tolist() == [0, 1] and grid_map[1, 4] == 2 + 6 + 4
    shares = TILES.member_shares(weights / weights.sum())
    assert sum(shares) == pytest.approx(1.0) and shares[0] == pytest.approx(sum(TILES.member_keys(0)) / weights.sum())
    with pytest.raises(ValueError, match="31 weights for 32 tokens"):
        TILES.grid_map(weights[:-1])


def test_figures_draw_every_step_the_held_keys_the_seams_and_the_shares():
    figure = draw_ring_arrivals(TILES, 2 + 29)
    assert [a.get_gid() for a in viz.find_artists(figure, "held:")] == ["held:0:3", "held:1:2", "held:2:1", "held:3:0"]
    assert len(viz.find_artists(figure, "query")) == 4
    weights = np.full(32, 1 / 32)
    figure = draw_query_attention(np.zeros((50, 60)), TILES, weights, 0)
    assert {a.get_gid() for a in viz.find_artists(figure, "seam:")} == {"seam:row:1", "seam:col:1"}
    seam = viz.find_artists(figure, "seam:row:1")[0]
    assert seam.get_ydata()[0] == pytest.approx(3 * 10)                   # 3 token rows of 10 px
    shares = sorted(a.get_text() for a in viz.find_artists(figure, "share:"))
    assert shares == ["rank 0: 34%", "rank 1: 28%", "rank 2: 19%", "rank 3: 19%"]
    assert "class/register tokens 6%" in figure.axes[0].get_title()
    assert viz.png_bytes(figure)[:4] == b"\x89PNG"


def test_a_timm_vit_s_weights_are_its_attention_row_and_the_widget_redraws_for_another_query():
    require_or_skip(missing_modules("timm"), "the attention of a timm ViT", MODELS_EXTRA)
    import timm

    from mpi4dl_nb.notebook.widgets import AttentionViewer

    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", img_size=64, num_classes=2, depth=2, embed_dim=48, num_heads=3,
                            reg_tokens=2)
    tokens = vit_token_grid(vit, (64, 64))
    assert tokens == TokenGrid(4, 4, prefix=3)
    image = torch.rand(1, 3, 64, 64)
    weights = vit_attention(vit, image, 5)
    captured = []
    attention = vit.blocks[-1].attn
    attention.fused_attn = False
    handle = attention.attn_drop.register_forward_hook(lambda module, args, out: captured.append(out))
    vit(image)
    handle.remove()
    assert np.abs(captured[0][0, :, 5].mean(0).detach().numpy() - weights).max() < 1e-6
    assert weights.sum() == pytest.approx(1)

    viewer = AttentionViewer(image[0], RingTokens(tokens, TileGrid(1, 4)), lambda q: vit_attention(vit, image, q))
    assert viewer.query == 0 and viewer.row.disabled and viewer.view.shown
    first = viewer.view.widget.value
    viewer.kind.value = "grid token"
    viewer.row.value, viewer.col.value = 3, 1
    assert viewer.query == 3 + 3 * 4 + 1 and viewer.view.widget.value != first
    assert [a.get_gid() for a in viz.find_artists(viewer.view.figure, "held:0:")] == ["held:0:1"]   # column 1
