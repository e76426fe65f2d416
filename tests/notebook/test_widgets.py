"""Widgets driven as a user would (set values, click), asserting on state and figure content."""

from __future__ import annotations

import numpy as np
import pytest

from mpi4dl_nb import ParallelConfig, viz
from mpi4dl_nb.comm.trace import Event
from mpi4dl_nb.models import build_model
from mpi4dl_nb.notebook.widgets import ConfigPanel, HaloViewer, StepThrough, TimelineView, TrainingProgress
from mpi4dl_nb.notebook.widgets.halo_viewer import WindowedLayer, windowed_layers
from mpi4dl_nb.pipeline.schedules import build_schedule, interleaved


@pytest.fixture(scope="module")
def small_resnet():
    return build_model("resnet", num_layers=11, num_filters=8, num_classes=2)


def test_config_panel_validates_live_and_redraws(small_resnet):
    panel = ConfigPanel(model=small_resnet, image_size=64, batch_size=2, devices=8)
    assert panel.config == ParallelConfig() and panel.error is None
    assert "mpiexec -n 5" in panel.world.value
    assert len(viz.find_artists(panel.layout_view.figure, "rank:")) == 5
    assert len(panel.plan.totals) == 5
    assert len(viz.find_artists(panel.memory_view.figure, "mem:estimate:")) == 5
    first_png = panel.layout_view.widget.value

    panel.controls["num_spatial_parts"].value = 3                  # user types 3
    assert panel.config is None and "perfect square" in panel.error
    assert "num_spatial_parts" in panel.status.value and "&#10007;" in panel.status.value

    panel.controls["slice_method"].value = "vertical"              # fix suggested by the message
    assert panel.config.world_size == 4 and panel.error is None
    assert len(viz.find_artists(panel.layout_view.figure, "rank:")) == 4
    assert panel.layout_view.widget.value != first_png

    panel.set(parts=2, batch_size=3)
    assert "batch_size 3" in panel.error
    panel.set(batch_size=4)
    assert panel.config.parts == 2
    heavier = panel.plan.ranks[0].activations
    panel.set(parts=1)
    assert panel.plan.ranks[0].activations < heavier * 1.01      # GPipe: 2 chunks of 2 vs 1 of 4

    panel.set(num_spatial_parts=9, slice_method="square")          # 9 + 1 > 8 devices
    assert "only 8 devices" in panel.error
    panel.set(num_spatial_parts=4, spatial_size=3)                 # more spatial stages than stages
    assert panel.config is None and panel.error.startswith("spatial_size")
    seen = []
    panel.on_change(seen.append)
    panel.set(spatial_size=1, times=1)
    assert seen[-1].gems and "m:S1" in " ".join(
        t.get_text() for t in viz.find_artists(panel.layout_view.figure, "rank-label:"))
    with pytest.raises(ValueError, match="unknown knob"):
        panel.set(splitsize=2)


def test_halo_viewer_follows_layer_tile_and_grid_choices(small_resnet):
    image = np.full((512, 512, 3), 200, dtype=np.uint8)
    viewer = HaloViewer(image, small_resnet, image_size=512)
    names = [layer.name for layer in viewer.layers]
    assert names[0] == "0.conv" and any("conv2" in n for n in names)
    assert viewer.halo.message_count == 8
    assert len(viz.find_artists(viewer.view.figure, "tile:")) == 4

    viewer.tile_choice.value = 3
    drawn = {a.get_gid() for a in viz.find_artists(viewer.view.figure, "halo:")}
    assert drawn == {"halo:tile3:top", "halo:tile3:left", "halo:tile3:top_left_corner"}
    assert "tile 3" in viewer.info.value and "receives" in viewer.info.value

    viewer.messages_box.value = False
    assert not viz.find_artists(viewer.view.figure, "msg:")

    viewer.slice_choice.value = "vertical"
    assert viewer.grid.rows == 1 and viewer.grid.cols == 4
    sides = {a.get_gid().split(":")[2] for a in viz.find_artists(viewer.view.figure, "halo:")}
    assert sides == {"left"}                     # tile 3 is now the right-most strip
    viewer.tile_choice.value = 1
    sides = {a.get_gid().split(":")[2] for a in viz.find_artists(viewer.view.figure, "halo:")}
    assert sides == {"left", "right"}

    stem = windowed_layers(small_resnet, 512)[0]
    assert (stem.height, stem.kernel, stem.padding) == (512, (3, 3), (1, 1))

    wide = WindowedLayer("wide", (16, 16), (9, 9), (1, 1), (4, 4))
    narrow = HaloViewer(image, [wide], num_spatial_parts=64)   # 2-px tiles, 4-px halo
    assert narrow.halo is None and "halo is wider than a tile" in narrow.error
    narrow.parts_choice.value = 4
    assert narrow.halo is not None and narrow.error is None
    assert narrow.halo.tile(0).halo["bottom"] == 4


def test_stepper_walks_the_schedule_order_back_and_forth():
    schedule = build_schedule(ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2,
                                             slice_method="vertical", parts=2))
    stepper = StepThrough(schedule)
    order = schedule.global_order()
    assert stepper.position == 0 and "press forward" in stepper.label.value
    first = stepper.forward()
    assert first is order[0] and stepper.current is order[0]
    assert order[0].describe() in stepper.label.value
    stepper.forward_button.click()
    assert stepper.position == 2 and stepper.history == order[:2]
    done = [a for a in viz.find_artists(stepper.view.figure, "cell:done")]
    assert len(done) == sum(1 for a in order[:2] if a.kind in ("F", "B", "ALLREDUCE", "OPTIM"))
    stepper.back_button.click()
    assert stepper.position == 1 and stepper.executed == 2
    stepper.end_button.click()
    assert stepper.position == len(order) == stepper.executed
    assert stepper.history == order
    assert not viz.find_artists(stepper.view.figure, "cell:todo")
    stepper.reset_button.click()
    assert stepper.position == 0


def test_timeline_filters_and_memory_bars():
    events = [Event(r, op, i * 1.0, i * 1.0 + 0.4, micro_batch=i) for r in range(3)
              for i, op in enumerate(["F", "halo", "B"])]
    view = TimelineView(events, measured=[1e6, 2e6, 3e6], estimate=[1.1e6, 2e6, 2.5e6])
    assert len(viz.find_artists(view.view.figure, "event:")) == 9
    view.rank_filter.value = (1,)
    assert len(view.visible) == 3 and all(e.rank == 1 for e in view.visible)
    assert view.op_filter.options == ("backward", "forward", "halo forward")   # the legend's names
    view.op_filter.value = ("halo forward",)
    assert [e.op for e in view.visible] == ["halo"]
    assert "halo forward: 400.0 ms" in view.summary.value
    assert len(viz.find_artists(view.memory_view.figure, "mem:")) == 6

    progress = TrainingProgress(3)
    losses = progress.run(lambda i: 1.0 / i, images_per_step=4)
    assert losses == [1.0, 0.5, pytest.approx(1 / 3)]
    assert progress.bar.value == 3 and "step 3/3" in progress.label.value
    assert "images/s" in progress.label.value
    with pytest.raises(ValueError, match="total_steps"):
        TrainingProgress(0)


def test_figure_view_keeps_aspect_ratio_fits_a_laptop_screen_and_clears():
    from matplotlib.figure import Figure

    from mpi4dl_nb.notebook.widgets.figure_view import FigureView, png_size

    view = FigureView(dpi=90, max_width=400, max_height=300)
    view.show(Figure(figsize=(12, 4)))                      # 1080x360 px at 90 dpi: too wide
    width, height = view.size
    assert width <= 400 and height <= 300
    png_w, png_h = png_size(view.widget.value)
    assert png_w / png_h == pytest.approx(width / height, rel=0.02)   # what is shown is the PNG's own shape
    assert view.widget.layout.width == f"{width}px" and view.widget.layout.height == "auto"
    assert view.widget.layout.align_self == "flex-start"                # a flex row cannot stretch it
    view.clear()
    assert view.figure is None and view.widget.value == b"" and view.widget.layout.display == "none"


def test_invalid_input_clears_the_last_valid_figures_and_table(small_resnet):
    panel = ConfigPanel(model=small_resnet, image_size=64, batch_size=2, devices=8)
    assert panel.layout_view.shown and panel.memory_view.shown and panel.memory_table.value
    panel.set(num_spatial_parts=3)
    assert panel.error and not panel.layout_view.shown and not panel.memory_view.shown
    assert panel.memory_table.value == "" and panel.world.value == ""
    panel.set(slice_method="vertical")
    assert panel.layout_view.shown and "world size" in panel.world.value

    image = np.full((64, 64, 3), 200, dtype=np.uint8)
    viewer = HaloViewer(image, [WindowedLayer("wide", (16, 16), (9, 9), (1, 1), (4, 4))])
    assert viewer.view.shown
    viewer.parts_choice.value = 64
    assert viewer.error and not viewer.view.shown and viewer.info.value == ""


def test_halo_viewer_explains_negative_halos_as_trims(small_resnet):
    image = np.full((512, 512, 3), 200, dtype=np.uint8)
    viewer = HaloViewer(image, small_resnet, image_size=512)
    viewer.layer_choice.value = next(i for i, layer in enumerate(viewer.layers) if "shortcut" in layer.name)
    text = viewer.describe()
    assert "-1" not in text and "trims bottom 1, right 1" in text
    assert "trim" in viewer.status.value
    viewer.layer_choice.value = 0
    assert "trim" not in viewer.status.value and "receives bottom 1, right 1" in viewer.describe()
    assert "zero padding top 1, left 1" in viewer.describe().splitlines()[0]


def test_stepper_text_is_plain_and_buttons_use_common_glyphs():
    stepper = StepThrough(build_schedule(ParallelConfig(split_size=2, spatial_size=0, parts=2)))
    stepper.forward()
    assert stepper.text().startswith("action 1/") and "<" not in stepper.text()
    assert "<b>" in stepper.label.value                  # the widget itself still shows bold HTML
    for button in (stepper.back_button, stepper.forward_button, stepper.end_button, stepper.reset_button):
        # ASCII plus the two triangles of Unicode's Geometric Shapes block that DejaVu Sans draws
        assert set(button.description) <= set(map(chr, range(32, 127))) | {"\u25b6", "\u25c0"}, button.description


def test_step_event_lines_split_compute_from_waiting_for_peers():
    from mpi4dl_nb.notebook.widgets.stepper import event_lines

    events = [Event(0, "halo", 0.010, 2.010, peer=1, bytes=512, extra={"layer": "0.conv"}),
              Event(0, "F", 0.0, 2.030, stage=0, micro_batch=0)]
    halo, forward = event_lines(events)
    assert "halo" in halo and "2000.0 ms" in halo and "peer 1" in halo
    assert "compute 30.0 ms" in forward and "waiting for peers 2000.0 ms" in forward


def test_one_rank_timeline_legend_clear_of_the_axis_label():
    fig = viz.draw_timeline([Event(0, op, i * 1.0, i * 1.0 + 0.4) for i, op in enumerate(["F", "halo", "B"])])
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(ax.xaxis.label.get_window_extent(renderer))
    assert not legend.overlaps(ax.get_window_extent(renderer))


def test_config_panel_has_balance_and_halo_d2():
    panel = ConfigPanel(ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4),
                        model=build_model("resnet", num_layers=11, num_filters=8, num_classes=2), image_size=128)
    assert panel.config.balance is None and panel.controls["balance"].value == ""
    default_totals = panel.plan.totals
    panel.set(balance=(2, 3))
    assert panel.config.balance == (2, 3) and panel.controls["balance"].value == "2,3"
    assert panel.plan is not None and panel.plan.totals != default_totals   # the estimate follows the cut
    panel.set(balance="4;1")
    assert panel.config is None and panel.error.startswith("balance:") and panel.plan is None
    panel.set(balance="", halo_d2=True)
    assert panel.config.halo_d2 and panel.config.balance is None


def test_auto_tune_shows_the_memory_limit_as_a_user_would_type_it():
    from mpi4dl_nb.measure.trials import ModelSpec
    from mpi4dl_nb.notebook.widgets import AutoTune

    tuner = AutoTune(None, ModelSpec("resnet", 11, 8, num_classes=2), 64, 2, memory_limit_mb=0.6 * 83.26)
    assert tuner.limit.value == 50.0 and tuner.best is None
    assert tuner.widget.children[0].children[-1].description == "Run auto-tune"


def test_stepper_names_the_chunk_of_an_interleaved_action():
    stepper = StepThrough(interleaved(2, 2, virtual_stages=2))
    while (action := stepper.forward(render=False)) is not None and not (action.kind.is_compute and action.stage == 2):
        pass
    assert action is not None and action.kind == "F"
    assert stepper.heading().endswith("the rank's chunk 1 of 2")
    stepper.reset()
    assert stepper.forward() is not None and stepper.current is not None and stepper.current.kind == "F"
    assert stepper.heading().endswith("the rank's chunk 0 of 2")
    plain = StepThrough(build_schedule(ParallelConfig(split_size=2, spatial_size=0, parts=2)))
    assert plain.forward() is not None and "the rank's chunk" not in plain.heading()
    assert viz.find_artists(stepper.view.figure, "chunk:")
