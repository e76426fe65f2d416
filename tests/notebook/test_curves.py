"""Learning curves: the plot helper draws each run's train and validation series; the widget overlays chosen runs."""
from __future__ import annotations

import mpi4dl_nb as dl
from mpi4dl_nb.evaluation.log import MetricsLog
from mpi4dl_nb.notebook.widgets import LearningCurves


def write_run(folder, losses, accuracies) -> None:
    log = MetricsLog(folder, folder.name, tensorboard=False)
    for step, loss in enumerate(losses, 1):
        log.write("train", step, {"loss": loss})
        if step % 2 == 0:
            log.write("eval", step, {"val_loss": loss + 0.1, "val_accuracy": accuracies[step // 2 - 1],
                                     "val_balanced_accuracy": 0.5})
    log.close()


def test_plot_and_widget_overlay_runs(tmp_path):
    write_run(tmp_path / "a", [1.0, 0.8, 0.6, 0.5], [0.5, 0.75])
    write_run(tmp_path / "b", [1.2, 1.1], [0.25])
    fig = dl.plot_learning_curves(tmp_path / "a", tmp_path / "b" / "metrics.jsonl")
    loss_ax, acc_ax = fig.axes
    lines = {line.get_label(): line for line in loss_ax.lines + acc_ax.lines}
    assert list(lines["a train"].get_xdata()) == [1, 2, 3, 4]
    assert list(lines["a train"].get_ydata()) == [1.0, 0.8, 0.6, 0.5]
    assert list(lines["a validation"].get_xdata()) == [2, 4]
    assert list(lines["b accuracy"].get_ydata()) == [0.25] and "b balanced" in lines
    widget = LearningCurves([tmp_path / "a", tmp_path / "b"])
    assert len(widget.view.figure.axes[0].lines) == 4
    widget.run_picker.value = ("b",)
    widget.train_box.value = False
    labels = [line.get_label() for line in widget.view.figure.axes[0].lines]
    assert labels == ["b validation"]
    write_run(tmp_path / "b", [1.2, 1.1, 0.9, 0.7], [0.25, 0.5])   # the run went on: reread
    widget.refresh()
    assert len(widget.view.figure.axes[1].lines[0].get_xdata()) == 2


def drawn(fig):
    """The figure drawn on an Agg canvas, and its renderer (window extents are measured on it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def test_legends_cover_no_line_point_and_stay_inside_the_figure(tmp_path):
    """Measured on the drawn figure: no plotted point of either panel lies in a legend's box, the legend is
    outside its panel and clear of its x-axis label, and nothing of it is cut off."""
    write_run(tmp_path / "a", [1.0, 0.8, 0.6, 0.5, 0.45, 0.4, 0.38, 0.3], [0.5, 0.75, 0.8, 1.0])
    write_run(tmp_path / "b", [1.2, 1.1, 0.9, 0.7], [0.25, 0.5])
    for runs in ([tmp_path / "a"], [tmp_path / "a", tmp_path / "b"]):
        fig = dl.plot_learning_curves(*runs)
        renderer = drawn(fig)
        legends = [ax.get_legend() for ax in fig.axes]
        assert all(legends) and len(legends) == 2
        for ax, legend in zip(fig.axes, legends):
            box = legend.get_window_extent(renderer)
            points = [xy for ax_ in fig.axes for line in ax_.lines
                      for xy in line.get_transform().transform(line.get_xydata())]
            assert len(points) > 10
            assert not any(box.contains(x, y) for x, y in points), f"{ax.get_title()}: the legend covers a point"
            assert not box.overlaps(ax.get_window_extent(renderer)), f"{ax.get_title()}: the legend is in the panel"
            assert not box.overlaps(ax.xaxis.label.get_window_extent(renderer))
            assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1), "cut off"


def test_legends_measure_a_legend_placed_on_the_lines():
    """The measurement above can fail: a legend placed on the data is caught."""
    fig = dl.plot_learning_curves([{"kind": "train", "step": s, "loss": 1.0} for s in range(1, 9)])
    loss_ax = fig.axes[0]
    legend = loss_ax.legend(loc="center")
    renderer = drawn(fig)
    points = loss_ax.lines[0].get_transform().transform(loss_ax.lines[0].get_xydata())
    assert any(legend.get_window_extent(renderer).contains(x, y) for x, y in points)
