"""viz drawings: what each figure contains (found by artist gid)."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from mpi4dl_nb import ParallelConfig, viz
from mpi4dl_nb.comm.trace import Event
from mpi4dl_nb.config import ScheduleKind
from mpi4dl_nb.pipeline.actions import Action, ActionKind
from mpi4dl_nb.pipeline.schedules import Schedule, build_schedule, interleaved, one_f_one_b, zb1
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


def _legend_names(fig) -> list[str]:
    return [text.get_text() for text in fig.axes[0].get_legend().get_texts()]


def test_interleaved_schedule_strips_each_cell_with_its_chunk_and_names_the_chunks():
    schedule = interleaved(2, 4, virtual_stages=2)
    fig = viz.draw_schedule(schedule, 10)
    assert _legend_names(fig) == ["forward", "backward", "all-reduce", "optimizer", "chunk 0 (s0,s1)",
                                  "chunk 1 (s2,s3)"]
    strips = viz.find_artists(fig, "chunk:")
    compute = [a for actions in schedule.per_rank for a in actions if a.kind.is_compute]
    assert len(strips) == len(compute)
    for strip in strips:                       # chunk:<rank>:<tick>:<chunk>:s<stage>
        _, rank, _, chunk, stage = strip.get_gid().split(":")
        assert int(chunk) == int(stage[1:]) // 2 and int(stage[1:]) % 2 == int(rank)
        assert strip.get_facecolor()[:3] == to_rgb(viz.chunk_color(int(chunk)))
    action_colors = {to_rgb(color) for color in viz.SCHEDULE_COLORS.values()}
    assert not action_colors & {to_rgb(viz.chunk_color(c)) for c in range(2)}
    assert not viz.find_artists(viz.draw_schedule(one_f_one_b(2, 4)), "chunk:")   # one stage per rank: no strips
    assert "chunk 0 (s0)" not in _legend_names(viz.draw_schedule(one_f_one_b(2, 4)))


def _split_backward_schedule() -> Schedule:
    """Two stages, one micro-batch, the backward split into I and W (drawn from hand-made actions)."""
    kinds = [[ActionKind.FORWARD, None, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT],
             [None, ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT]]
    per_rank = [[Action(kind, rank=rank, tick=tick, stage=rank, micro_batch=0) for tick, kind in enumerate(row)
                 if kind is not None] for rank, row in enumerate(kinds)]
    return Schedule(ParallelConfig(split_size=2, spatial_size=0), ScheduleKind.GPIPE, 4, per_rank)


def test_split_backward_cells_and_bars_in_their_own_two_colours_with_a_legend():
    fig = viz.draw_schedule(_split_backward_schedule(), 8)
    cells = {cell.get_gid().split(":")[-1]: to_rgb(cell.get_facecolor()) for cell in viz.find_artists(fig, "cell:")}
    assert {"F0", "I0", "W0"} <= set(cells)
    assert len({cells["F0"], cells["I0"], cells["W0"], to_rgb(viz.SCHEDULE_COLORS[ActionKind.BACKWARD])}) == 4
    assert _legend_names(fig) == ["forward", "input gradient", "weight gradient"]
    events = [Event(0, op, i * 1.0, i * 1.0 + 0.5, stage=0, micro_batch=0) for i, op in enumerate("FBIW")]
    timeline = viz.draw_timeline(events)
    bars = {bar.get_gid(): tuple(bar.get_facecolor()[0]) for bar in viz.find_artists(timeline, "event:")}
    assert len(set(bars.values())) == 4                          # F, B, I, W: four colours
    assert _legend_names(timeline) == ["forward", "backward", "input gradient", "weight gradient"]
    assert viz.op_family("I") is viz.OpFamily.INPUT_GRADIENT and viz.op_family("W") is viz.OpFamily.WEIGHT_GRADIENT


def test_timeline_names_the_stage_of_compute_bars_where_a_rank_ran_several():
    chunked = [Event(0, "F", 0.0, 1.0, stage=0, micro_batch=1), Event(0, "F", 1.0, 2.0, stage=2, micro_batch=1)]
    labels = [t.get_text() for t in viz.find_artists(viz.draw_timeline(chunked), "event-label:")]
    assert labels == ["1@s0", "1@s2"]
    single = [Event(0, "F", 0.0, 1.0, stage=0, micro_batch=1), Event(1, "F", 1.0, 2.0, stage=1, micro_batch=1)]
    assert [t.get_text() for t in viz.find_artists(viz.draw_timeline(single), "event-label:")] == ["1", "1"]


def test_zb1_schedule_draws_its_input_and_weight_gradients_apart():
    schedule = zb1(2, 4)
    fig = viz.draw_schedule(schedule, len(schedule.global_order()))
    assert _legend_names(fig) == ["forward", "input gradient", "weight gradient", "all-reduce", "optimizer"]
    cells = viz.find_artists(fig, "cell:")
    colours = {cell.get_gid().split(":")[-1][0]: to_rgb(cell.get_facecolor()) for cell in cells}
    assert len({colours["F"], colours["I"], colours["W"]}) == 3
    assert colours["I"] == to_rgb(viz.OpFamily.INPUT_GRADIENT.color)
    labels = {cell.get_gid().split(":")[-1] for cell in cells}
    assert {f"{kind}{u}" for kind in "FIW" for u in range(4)} <= labels
