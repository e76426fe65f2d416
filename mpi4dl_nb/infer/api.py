"""``dl.infer_slide``: a trained checkpoint over a whole slide, from Python, a notebook cluster or the command."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .runner import InferSettings, Runner

if TYPE_CHECKING:
    from ..comm.protocol import Comm


def infer_slide(checkpoint: str | Path, slide: str | Path, output: str | Path | Sequence[str | Path], *,
                ctx: Comm | None = None, **options: Any) -> dict[str, object] | None:
    """Run the checkpoint's network over ``slide``, writing ``output`` (.npy / .tif / .png, or a list of them).

    Collective: call it on every rank of a world of ``num_spatial_parts`` ranks (one process:
    ``num_spatial_parts=1``). ``options`` are :class:`InferSettings` fields: ``level``,
    ``num_spatial_parts``, ``slice_method``, ``window``, ``dtype``, ``tissue_only``,
    ``min_tissue``, ``batch_windows``, ``resume``, ``overwrite``, ``output_stride``,
    ``heat_class``, ``model``, ``max_window_rows``, ``memory_budget``, ``overlay_side``, ``progress``,
    ``keep_trace`` (the per-rank timeline in ``summary["events"]``). Returns the summary
    (the command's JSON line) on rank 0, None on the other ranks; bad input raises
    ``ConfigError``/``ValueError``/``FileNotFoundError`` (``SetupFailed`` when one rank refused) on every rank.
    """
    outputs = [output] if isinstance(output, (str, Path)) else list(output)
    options.setdefault("progress", False)
    settings = InferSettings(checkpoint=str(checkpoint), slide=str(slide),
                             outputs=tuple(str(p) for p in outputs), **options)
    if ctx is None:
        from ..comm.context import init

        ctx = init()
    summary = Runner(settings, ctx).run()
    return summary.as_dict() if summary is not None else None
