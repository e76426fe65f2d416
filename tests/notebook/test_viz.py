"""viz drawings: what each figure contains (found by artist gid)."""

from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb import ParallelConfig, viz
from mpi4dl_nb.comm.trace import Event
from mpi4dl_nb.pipeline.schedules import build_schedule
from mpi4dl_nb.spatial.geometry import TileGrid


def test_rank_layout_has_one_box_per_rank_coloured_by_stage():
    cfg = ParallelConfig(split_size=3, spatial_size=1, num_spatial_parts=4, local_dp=2)
    fig = viz.draw_rank_layout(cfg)
    boxes = viz.find_artists(fig, "rank:")
    assert len(boxes) == cfg.world_size == 8
    colors = {b.get_gid(): b.get_facecolor()[:3] for b in boxes}
    assert colors["rank:0"] == colors["rank:3"]           # tiles of stage 0
    assert colors["rank:4"] == colors["rank:5"]           # local-DP copies of stage 1
    assert colors["rank:0"] != colors["rank:4"] != colors["rank:6"]
    assert len(viz.find_artists(fig, "stage-label:")) == 3
    # tiles 0..3 of a 2x2 grid: tile 1 is right of tile 0, tile 2 below it
    x = {b.get_gid(): b.get_xy() for b in boxes}
    assert x["rank:1"][0] > x["rank:0"][0] and x["rank:2"][1] < x["rank:0"][1]


def test_gems_layout_labels_the_mirror_stage():
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2,
                         slice_method="vertical", times=1)
    fig = viz.draw_rank_layout(cfg)
    labels = {t.get_gid(): t.get_text() for t in viz.find_artists(fig, "rank-label:")}
    assert "m:S1" in labels["rank-label:0"] and "m:S0" in labels["rank-label:2"]


def test_interleaved_layout_and_schedule_name_each_ranks_chunks():
    cfg = ParallelConfig(split_size=4, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2,
                         schedule="interleaved", virtual_stages=2)
    labels = {t.get_gid(): t.get_text() for t in viz.find_artists(viz.draw_rank_layout(cfg), "rank-label:")}
    assert labels["rank-label:0"].endswith("+S2") and labels["rank-label:2"].endswith("+S3")
    assert "+" not in labels["rank-label:1"]                  # tile 1 holds stage 0 only
    cells = [b.get_gid().split(":")[-1] for b in viz.find_artists(viz.draw_schedule(build_schedule(cfg)), "cell:")]
    assert {"F0@s0", "F0@s2", "B1@s3"} <= set(cells)


def test_halo_bands_include_corners_from_geometry():
    grid = TileGrid(2, 2)
    halo = grid.layer_halo(64, 64, kernel=5, padding=2)
    bands = viz.halo_bands(halo.tile(0), 64, 64)
    assert bands["bottom"] == (32, 34, 0, 32)
    assert bands["right"] == (0, 34, 32, 34)          # full needed rows: corner included
    assert bands["bottom_right_corner"] == (32, 34, 32, 34)
    assert "top" not in bands and "left" not in bands   # image border: padding, no halo


def test_tiles_and_halos_figure_scales_feature_map_onto_image():
    image = np.zeros((512, 512, 3), dtype=np.uint8)
    grid = TileGrid(2, 2)
    halo = grid.layer_halo(128, 128, kernel=3, padding=1, name="conv")
    fig = viz.draw_tiles_and_halos(image, grid, halo)
    assert len(viz.find_artists(fig, "tile:")) == 4
    msgs = viz.find_artists(fig, "msg:")
    assert len([m for m in msgs if "label" not in m.get_gid()]) == halo.message_count == 8
    bottom = [a for a in viz.find_artists(fig, "halo:tile0:bottom") if not a.get_gid().endswith("corner")][0]
    # 1 halo row of a 128 map drawn on a 512 image: 4 px high, starting at row 64*4
    assert bottom.get_height() == pytest.approx(4) and bottom.get_y() == pytest.approx(256)
    only3 = viz.draw_tiles_and_halos(image, grid, halo, tiles=[3])
    assert {a.get_gid().split(":")[1] for a in viz.find_artists(only3, "halo:")} == {"tile3"}
    assert all("3" in a.get_gid() for a in viz.find_artists(only3, "msg:"))


def test_timeline_one_bar_per_event_on_its_rank_row():
    events = [Event(r, op, i * 1.0, i * 1.0 + 0.5, micro_batch=i) for r in range(3)
              for i, op in enumerate(["F", "B", "ALLREDUCE"])]
    fig = viz.draw_timeline(events, highlight=4)
    bars = viz.find_artists(fig, "event:")
    assert len(bars) == 9
    bar = [b for b in bars if b.get_gid() == "event:4:1:B"][0]
    assert bar.get_linewidth()[0] == pytest.approx(2.5)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]


def test_memory_bars_heights_in_megabytes():
    fig = viz.draw_memory_bars([2 ** 20, 3 * 2 ** 20], [2 * 2 ** 20, 2 ** 20])
    heights = {a.get_gid(): a.get_height() for a in viz.find_artists(fig, "mem:")}
    assert heights == {"mem:measured:0": 1, "mem:measured:1": 3, "mem:estimate:0": 2,
                       "mem:estimate:1": 1}
    with pytest.raises(ValueError, match="measured="):
        viz.draw_memory_bars()


def test_schedule_grid_marks_done_actions_and_current_p2p():
    schedule = build_schedule(ParallelConfig(split_size=2, spatial_size=0, parts=2))
    order = schedule.global_order()
    send = next(i for i, a in enumerate(order) if a.kind == "SEND_ACT")
    fig = viz.draw_schedule(schedule, send + 1)
    cells = viz.find_artists(fig, "cell:")
    done = [c for c in cells if c.get_gid().startswith("cell:done")]
    assert len(done) == sum(1 for a in order[:send + 1] if a.kind in ("F", "B", "ALLREDUCE", "OPTIM"))
    arrows = viz.find_artists(fig, "p2p:")
    assert [a.get_gid() for a in arrows] == ["p2p:SEND_ACT:0->1"]


def test_layout_title_names_micro_batches_and_only_real_spatial_stages():
    from mpi4dl_nb import ParallelConfig
    from mpi4dl_nb.notebook import viz

    cfg = ParallelConfig(split_size=2, spatial_size=0, parts=2, data_parallel=2)
    title = viz.draw_rank_layout(cfg).axes[0].get_title()
    assert "parts 2" in title and "dp 2" in title and "spatial" not in title
    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)
    title = viz.draw_rank_layout(cfg).axes[0].get_title()
    assert "spatial 1 x 4 tiles (square)" in title and "parts 1" in title


def test_timeline_colours_halo_directions_and_receive_kinds_apart_and_names_them():
    ops = ["F", "halo", "halo_backward", "RECV_ACT", "RECV_GRAD", "SEND_ACT", "SEND_GRAD", "B", "ALLREDUCE", "OPTIM"]
    events = [Event(0, op, i * 1.0, i * 1.0 + 0.5) for i, op in enumerate(ops)] + [Event(1, "halo:top", 0.0, 0.2)]
    fig = viz.draw_timeline(events)
    bars = {bar.get_gid().split(":", 3)[3]: tuple(bar.get_facecolor()[0]) for bar in viz.find_artists(fig, "event:")}
    four = [bars[op] for op in ("halo", "halo_backward", "RECV_ACT", "RECV_GRAD")]
    assert len(set(four)) == 4, "halo forward/backward and activation/gradient receives share a colour"
    assert len({bars[op] for op in ops}) == len(ops)                # every family its own colour
    assert bars["halo:top"] == bars["halo"]                          # the detail after ':' keeps the family
    legend = fig.axes[0].get_legend()
    names = [text.get_text() for text in legend.get_texts()]
    assert names == ["forward", "backward", "halo forward", "halo backward", "send activation",
                     "receive activation", "send gradient", "receive gradient", "all-reduce", "optimizer"]
    swatches = dict(zip(names, (tuple(h.get_facecolor()) for h in legend.legend_handles)))
    assert swatches["halo backward"] == bars["halo_backward"] and swatches["receive gradient"] == bars["RECV_GRAD"]


def test_op_families_by_name_and_unknown_ops_named_by_their_key():
    assert viz.op_family("RECV_ACT") is viz.OpFamily.RECEIVE_ACTIVATION
    assert viz.op_family("halo_backward:left") is viz.OpFamily.HALO_BACKWARD
    assert viz.op_family("all_reduce grads") is viz.OpFamily.ALLREDUCE
    assert viz.op_family("read") is None and viz.op_label("read:level0") == "read"
    assert viz.op_color("read") == viz.OTHER_OP_COLOR
    assert len({family.color for family in viz.OpFamily} | {viz.OTHER_OP_COLOR}) == len(viz.OpFamily) + 1
    entries = viz.legend_entries(["write", "B", "F", "write"])
    assert list(entries) == ["forward", "backward", "write"]
