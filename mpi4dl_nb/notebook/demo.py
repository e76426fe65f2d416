"""``make demo``: run the flagship notebook headless on a local MPI cluster, write the executed
notebook, an HTML export and its figures to ``out/``, and print a summary (exit 2: not exact, 3: does not learn).

``python -m mpi4dl_nb.notebook.demo [--notebook PATH] [--out DIR] [--timeout SECONDS] [--kernel NAME]``
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parents[2]   # the checkout: mpi4dl_nb/notebook/demo.py -> ../..
FLAGSHIP = ROOT / "notebooks" / "04_hybrid_training_pathology.ipynb"
SUMMARY_MARK = "MPI4DL_SUMMARY "


@dataclass(frozen=True)
class DemoSummary:
    """What the flagship notebook prints after ``MPI4DL_SUMMARY`` (one JSON line): its run in figures."""

    configuration: dict[str, object]
    world_size: int
    image_size: int
    batch_size: int
    steps: int
    exact: bool
    max_loss_error: float
    max_weight_error: float
    images_per_second: float
    memory_measured_mb: list[float]
    memory_estimate_mb: list[float]
    serial_images_per_second: float | None = None    # the one-process reference, when the notebook ran it
    serial_memory_mb: float | None = None
    memory_ratio: float | None = None
    held_out_steps: list[int] | None = None       # the learning-curve run: the steps it evaluated at,
    held_out_accuracy: list[float] | None = None  # the held-out accuracy at each,
    chance_accuracy: float | None = None          # and what always guessing the larger class scores
    held_out_images: int | None = None
    held_out_crops: int | None = None
    curve_steps: int | None = None
    curve_batch_size: int | None = None

    @property
    def learns(self) -> bool:
        """Whether the last held-out accuracy is above chance and above the first evaluation's."""
        accuracy, chance = self.held_out_accuracy, self.chance_accuracy
        if not accuracy or chance is None:
            return False
        return accuracy[-1] > max(chance, accuracy[0])

    @classmethod
    def from_json(cls, text: str) -> DemoSummary:
        """The summary in ``text`` (keys this reader does not know are left out)."""
        record = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in record.items() if key in known})


def _kernel_name(requested: str | None) -> str:
    """The requested kernel, else 'mpi4dl-nb' if installed, else 'python3'."""
    if requested:
        return requested
    from jupyter_client.kernelspec import KernelSpecManager

    return "mpi4dl-nb" if "mpi4dl-nb" in KernelSpecManager().find_kernel_specs() else "python3"


def execute(path: Path, timeout: int, kernel: str) -> NotebookNode:
    """Run the notebook top to bottom (raises nbclient's CellExecutionError on a failing cell)."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name=kernel,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return notebook


def save_figures(notebook: NotebookNode, directory: Path, stem: str) -> list[Path]:
    """Every PNG output of the notebook as ``<stem>_cell<k>_<j>.png``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for k, cell in enumerate(notebook.cells):
        for j, output in enumerate(cell.get("outputs", [])):
            data = output.get("data", {})
            if "image/png" in data:
                path = directory / f"{stem}_cell{k:02d}_{j}.png"
                path.write_bytes(base64.b64decode(data["image/png"]))
                written.append(path)
    return written


def find_summary(notebook: NotebookNode) -> DemoSummary | None:
    """The summary the flagship prints after ``MPI4DL_SUMMARY``."""
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            for line in str(output.get("text", "")).splitlines():
                if line.startswith(SUMMARY_MARK):
                    return DemoSummary.from_json(line[len(SUMMARY_MARK):])
    return None


def export_html(notebook: NotebookNode, path: Path) -> Path:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(notebook)
    path.write_text(body, encoding="utf-8")
    return path


def format_summary(summary: DemoSummary) -> str:
    knobs = ", ".join(f"{k}={v}" for k, v in summary.configuration.items() if v not in (None, False))
    lines = [
        f"configuration : {knobs}",
        f"world size    : {summary.world_size} MPI ranks, image {summary.image_size}px, "
        f"batch {summary.batch_size}, {summary.steps} steps (float64)",
        f"exactness     : {'EXACT' if summary.exact else 'NOT EXACT'} vs one process "
        f"(max |loss diff| {summary.max_loss_error:.1e}, max |weight diff| "
        f"{summary.max_weight_error:.1e})",
        f"throughput    : {summary.images_per_second:.2f} images/s (shared 2-core machine)",
        "memory / rank : " + "  ".join(
            f"r{r}: {m:.1f} MB (est. {e:.1f})" for r, (m, e) in
            enumerate(zip(summary.memory_measured_mb, summary.memory_estimate_mb))),
    ]
    serial_mb = summary.serial_memory_mb
    if serial_mb is not None:
        lines.append(f"one process   : {summary.serial_images_per_second or 0.0:.2f} images/s, {serial_mb:.1f} MB "
                     f"(largest rank: {max(summary.memory_measured_mb) / serial_mb:.2f}x)")
    lines.append(held_out_line(summary))
    return "\n".join(lines)


def held_out_line(summary: DemoSummary) -> str:
    """The learning-curve run in one line: held-out accuracy first and last, against chance."""
    accuracy, steps = summary.held_out_accuracy, summary.held_out_steps
    if not accuracy or not steps or summary.chance_accuracy is None:
        return "held-out      : no learning-curve run in the notebook's summary"
    verdict = "LEARNS" if summary.learns else "DOES NOT LEARN"
    return (f"held-out      : accuracy {accuracy[-1]:.2f} after {steps[-1]} steps (first evaluation, step {steps[0]}: "
            f"{accuracy[0]:.2f}; chance {summary.chance_accuracy:.2f}) on {summary.held_out_images} images of "
            f"{summary.held_out_crops} crops never trained on: {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", type=Path, default=FLAGSHIP)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument("--kernel", default=None, help="kernel name (default mpi4dl-nb, else python3)")
    args = parser.parse_args(argv)
    if not args.notebook.exists():
        parser.error(f"--notebook {args.notebook} does not exist; run `make notebooks`")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    kernel = _kernel_name(args.kernel)
    print(f"running {args.notebook.name} headless (kernel {kernel}) on a local MPI cluster ...",
          flush=True)
    start = time.monotonic()
    try:
        notebook = execute(args.notebook, args.timeout, kernel)
    except Exception as exc:  # the kernel (and its cluster) is shut down by nbclient
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    import nbformat

    stem = args.notebook.stem
    executed = out / f"{stem}.ipynb"
    nbformat.write(notebook, executed)
    html = export_html(notebook, out / f"{stem}.html")
    figures = save_figures(notebook, out / "figures", stem)
    summary = find_summary(notebook)
    print(f"done in {time.monotonic() - start:.0f} s")
    print(f"executed notebook: {executed}\nHTML export      : {html}\nfigures          : "
          f"{len(figures)} PNG files in {out / 'figures'}")
    if summary is None:
        print("no MPI4DL_SUMMARY line found in the notebook output", file=sys.stderr)
        return 1
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    print(format_summary(summary))
    return exit_code(summary)


EXIT_NOT_EXACT, EXIT_NOT_LEARNING = 2, 3


def exit_code(summary: DemoSummary) -> int:
    """0 when the run is exact and the model learns; else why not (not exact first)."""
    if not summary.exact:
        return EXIT_NOT_EXACT
    return 0 if summary.learns else EXIT_NOT_LEARNING


if __name__ == "__main__":
    sys.exit(main())
