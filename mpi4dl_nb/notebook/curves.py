"""Learning curves from metrics logs (pure matplotlib): loss and accuracy vs step, train and validation, overlaid."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from ..evaluation.log import read_metrics

Record = Mapping[str, object]                   # one line of a metrics log (``evaluation.log``)
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


def plot_learning_curves(*runs: Run, labels: Sequence[str] | None = None, show_train: bool = True,
                         show_validation: bool = True, figure: Figure | None = None) -> Figure:
    """Loss (left) and accuracy (right) against the step for each run, one colour per run.

    Train loss is drawn per step (thin line), validation loss and accuracy at each evaluation
    (markers, dashed); the right panel also shows the balanced accuracy (dotted). ``runs``:
    log directories (``--log-dir``), ``metrics.jsonl`` files, or lists of their records.
    """
    fig = figure if figure is not None else Figure(figsize=(9, 3.4))
    fig.clear()
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
            acc_ax.plot(*series(records, "eval", "val_accuracy"), color=colour, ls="--", marker="o", ms=4,
                        label=f"{name} accuracy")
            acc_ax.plot(*series(records, "eval", "val_balanced_accuracy"), color=colour, ls=":",
                        marker="s", ms=3, label=f"{name} balanced")
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    acc_ax.set(xlabel="step", ylabel="validation accuracy", title="validation accuracy", ylim=(0, 1.02))
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig
