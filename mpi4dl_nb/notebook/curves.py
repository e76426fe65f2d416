"""Learning curves from metrics logs (pure matplotlib): loss and accuracy vs step, train and validation, overlaid."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..evaluation.log import read_metrics

Record = Mapping[str, object]                   # one line of a metrics log (``evaluation.log``)
# the right panel's validation figures: key, line style, marker, legend text (segmentation runs: pixel accuracy, Dice)
RIGHT_PANEL = (("val_accuracy", "--", "o", "accuracy"), ("val_balanced_accuracy", ":", "s", "balanced"),
               ("val_pixel_accuracy", "--", "o", "pixel accuracy"), ("val_mean_dice", "-.", "D", "Dice"))
Run = str | Path | Sequence[Record]             # a log directory, a metrics.jsonl, or its records


def _records(run: Run) -> Sequence[Record]:
    return read_metrics(run) if isinstance(run, (str, Path)) else run


def _name(run: Run, number: int) -> str:
    if isinstance(run, (str, Path)):
        path = Path(run)
        return (path.parent if path.suffix == ".jsonl" else path).name or str(path)
    return f"run {number + 1}"


def series(records: Sequence[Record], kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in the records of ``kind`` ('train' or 'eval'), skipping missing values."""
    points = [(int(step), float(value)) for r in records
              if r.get("kind") == kind and isinstance(value := r.get(key), (int, float))
              and isinstance(step := r.get("step"), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def _mark_best(records: Sequence[Record], colour: str, name: str, loss_ax: Axes, acc_ax: Axes) -> None:
    """A star on the evaluation whose checkpoint a run kept as its best (``--keep-best``), in the panel of its
    metric (ROC AUC has none: the star goes on the validation loss)."""
    marks = [r for r in records if r.get("kind") == "eval" and isinstance(r.get("best"), Mapping)]
    if not marks:
        return
    last = marks[-1]
    best = last["best"]
    assert isinstance(best, Mapping)
    metric = str(best.get("metric"))
    ax, key = (acc_ax, metric) if metric in [key for key, *_ in RIGHT_PANEL] else (loss_ax, "val_loss")
    value, step = last.get(key), last.get("step")
    if isinstance(value, (int, float)) and isinstance(step, (int, float)):
        ax.plot([step], [value], color=colour, marker="*", ms=14, ls="none", markeredgecolor="black",
                label=f"{name} best ({metric}), kept")


def plot_learning_curves(*runs: Run, labels: Sequence[str] | None = None, show_train: bool = True,
                         show_validation: bool = True, figure: Figure | None = None) -> Figure:
    """Loss (left) and accuracy (right) against the step for each run, one colour per run.

    Train loss is drawn per step (thin line), validation loss and accuracy at each evaluation
    (markers, dashed); the right panel also shows the balanced accuracy (dotted), for segmentation runs the pixel
    accuracy and the mean Dice over the classes (dash-dot); a star marks the evaluation
    whose checkpoint ``--keep-best`` kept. Each panel's legend sits below it, clear of the lines. ``runs``:
    log directories (``--log-dir``), ``metrics.jsonl`` files, or lists of their records.
    """
    fig = figure if figure is not None else Figure(figsize=(9, 4.2))
    fig.clear()
    fig.set_layout_engine("constrained")   # makes room for the legends below the panels
    loss_ax, acc_ax = fig.subplots(1, 2)
    for number, run in enumerate(runs):
        records = _records(run)
        name = labels[number] if labels is not None else _name(run, number)
        colour = f"C{number % 10}"
        if show_train:
            loss_ax.plot(*series(records, "train", "loss"), color=colour, lw=1, alpha=0.7,
                         label=f"{name} train")
        if show_validation:
            loss_ax.plot(*series(records, "eval", "val_loss"), color=colour, ls="--", marker="o", ms=4,
                         label=f"{name} validation")
            for key, style, marker, what in RIGHT_PANEL:
                steps, values = series(records, "eval", key)
                if steps:
                    acc_ax.plot(steps, values, color=colour, ls=style, marker=marker, ms=3 if marker != "o" else 4,
                                label=f"{name} {what}")
            _mark_best(records, colour, name, loss_ax, acc_ax)
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    acc_ax.set(xlabel="step", ylabel="validation accuracy / Dice", title="validation accuracy / Dice", ylim=(0, 1.02))
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole
        if ax.lines:   # below the panel, outside the axes: it covers no line however many runs are drawn
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=2, frameon=False)
    return fig
