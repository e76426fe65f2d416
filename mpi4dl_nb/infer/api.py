"""``dl.infer_slide``: a trained checkpoint over a whole slide, from Python, a notebook cluster or the command;
``infer_slides``: slide-level inference of a whole-slide model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Choice
from .runner import SlideRunner
from .settings import InferSettings

if TYPE_CHECKING:
    from ..comm.protocol import Comm


def infer_slide(checkpoint: str | Path, slide: str | Path, output: str | Path | Sequence[str | Path], *,
                ctx: Comm | None = None, **options: Any) -> dict[str, object] | None:
    """Run the checkpoint's network over ``slide``, writing ``output`` (.npy / .tif / .geojson / .csv / .png, or a list
    of them; ``PATH.tif:labels|probabilities|preview`` chooses a TIFF's content, see ``infer/outputs.py``).

    Collective: call it on every rank of a world of ``num_spatial_parts`` ranks (one process:
    ``num_spatial_parts=1``). ``options`` are :class:`InferSettings` fields: ``level``,
    ``num_spatial_parts``, ``slice_method``, ``window``, ``dtype``, ``tissue_only``,
    ``min_tissue``, ``batch_windows``, ``resume``, ``overwrite``, ``output_stride``,
    ``heat_class``, ``model`` (a family to refuse others; or the model object of a run built in Python, an
    nn.Module or its layer list), ``max_window_rows``, ``memory_budget``, ``overlay_side``, ``progress``,
    ``keep_trace`` (the per-rank timeline in ``summary["events"]``), ``mpp`` / ``magnification`` / ``source_mpp``
    (resolution), ``task``, ``threshold``, ``min_area``, ``exclude_classes`` (.geojson). Returns the summary
    (the command's JSON line) on rank 0, None on the other ranks; bad input raises
    ``ConfigError``/``ValueError``/``FileNotFoundError`` (``SetupFailed`` when one rank refused) on every rank.
    """
    outputs = [output] if isinstance(output, (str, Path)) else list(output)
    options.setdefault("progress", False)
    network = options.pop("model", None)    # a family name to check against, or the model object itself
    if network is not None and not isinstance(network, (str, Choice)):
        return infer_with_model(checkpoint, network, slide, outputs, ctx, options)
    options["model"] = network
    settings = InferSettings(checkpoint=str(checkpoint), slide=str(slide),
                             outputs=tuple(str(p) for p in outputs), **options)
    if ctx is None:
        from ..comm.context import init

        ctx = init()
    summary = SlideRunner(settings, ctx).run()
    return summary.as_dict() if summary is not None else None


def infer_with_model(checkpoint: str | Path, model: object, slide: str | Path, outputs: Sequence[str | Path],
                     ctx: Comm | None, options: dict[str, Any]) -> dict[str, object] | None:
    """``infer_slide`` with the model object a run built in Python (its weights taken from ``checkpoint``)."""
    from torch import nn

    from .trained import load_network

    if not isinstance(model, nn.Module) and not (isinstance(model, (list, tuple))
                                                 and all(isinstance(m, nn.Module) for m in model)):
        raise TypeError(f"model: a family name, an nn.Module or a layer list, not a {type(model).__name__}")
    settings = InferSettings(checkpoint=str(checkpoint), slide=str(slide),
                             outputs=tuple(str(p) for p in outputs), **options)
    trained = load_network(settings.checkpoint, dtype=settings.torch_dtype, output_stride=settings.output_stride,
                           task=settings.task, model=model)
    if ctx is None:
        from ..comm.context import init

        ctx = init()
    summary = SlideRunner(settings, ctx, trained).run()
    return summary.as_dict() if summary is not None else None


def infer_slides(checkpoint: str | Path, slides: str | Path | Sequence[str | Path], output: str | Path, *,
                 ctx: Comm | None = None, **options: Any) -> dict[str, object] | None:
    """Slide-level inference of a ``train --whole-slide`` checkpoint (``infer --slides A,B --output DIR``): one
    prediction per slide in ``output/slides.csv`` and, for attention/max heads, each slide's map (slide-aligned
    OME-TIFF and GeoJSON); see docs/inference.md, "Slide-level inference".

    ``slides``: slide paths, a folder, a list file or a cohort manifest ``FILE.csv`` (labels and patients joined).
    Collective over ``num_spatial_parts`` ranks (default 1: one process). ``options`` are
    :class:`SlideLevelSettings` fields: ``num_spatial_parts``, ``slice_method``, ``dtype``, ``level``, ``mpp``,
    ``magnification``, ``source_mpp``, ``overwrite``, ``stain_normalize``. Returns the summary (slides, done,
    failed, the table's path) on rank 0, None elsewhere; bad input raises ``ConfigError``/``SetupFailed``.
    """
    from .slide_level import SlideLevelSettings, run_slide_level

    source = ",".join(str(s) for s in slides) if not isinstance(slides, (str, Path)) else str(slides)
    settings = SlideLevelSettings(checkpoint=str(checkpoint), slides=source, output=Path(output), **options)
    if ctx is None:
        from ..comm.context import init

        ctx = init()
    summary = run_slide_level(settings, ctx)
    return summary.as_dict() if summary is not None else None

