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
