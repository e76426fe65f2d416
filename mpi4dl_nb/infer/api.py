"""The Python entries of inference: ``dl.infer`` (the ``infer`` command's job from keywords named like its flags),
``dl.infer_slide`` (one slide, from Python, a notebook cluster or a model object), ``infer_slides`` (slide-level
inference of a whole-slide model)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Choice
from .execute import run_infer
from .job import InferJob, check_slide_level, readable_record
from .runner import SlideRunner
from .slide_level import run_slide_level
from .trained import load_network

if TYPE_CHECKING:
    from ..comm.protocol import Comm
    from .trained import TrainedNetwork

# dl.infer_slide's and infer_slides' option names where they differ from the flags' keywords
OPTION_NAMES = {"level": "slide_level", "exclude_classes": "exclude_class"}


def context(ctx: Comm | None, job: InferJob) -> Comm:
    """The given context, else a new one on the job's device and data plane."""
    if ctx is not None:
        return ctx
    from ..comm.context import init

    return init(backend=job.device.backend, device=job.device.device)


def infer(*, ctx: Comm | None = None, **keywords: object) -> dict[str, object] | None:
    """``python -m mpi4dl_nb infer`` from Python, on every rank of the job (collective): the keywords name its flags
    (``checkpoint="ckpt", slide="s.svs", output=["m.tif", "m.geojson"], num_spatial_parts=4``; ``slides``,
    ``cohort``, ``volume``, ``slide_level``, ``exclude_class``, ...) and build the command's InferJob; its kind (one
    slide, a cohort, slide-level, a volume) is the command's. Returns the summary (the command's JSON line) on rank 0,
    None elsewhere. ConfigError for a setting refused before any rank talks, SetupFailed (every rank, one message) for
    a set-up refused on some rank, SlideFailed when a slide cannot be read during the run."""
    checked = InferJob.from_keywords(keywords).check()
    result = run_infer(checked, context(ctx, checked.job))
    return result.as_dict() if result is not None else None


def option_keywords(options: Mapping[str, object]) -> dict[str, object]:
    """``infer_slide``'s and ``infer_slides``' options as the flags' keywords (``level`` is ``slide_level``)."""
    return {OPTION_NAMES.get(name, name): value for name, value in options.items()}


def infer_slide(checkpoint: str | Path, slide: str | Path, output: str | Path | Sequence[str | Path], *,
                ctx: Comm | None = None, **options: object) -> dict[str, object] | None:
    """Run the checkpoint's network over ``slide``, writing ``output`` (.npy / .tif / .geojson / .csv / .png, or a list
    of them; ``PATH.tif:labels|probabilities|preview`` chooses a TIFF's content, see ``infer/outputs/kinds.py``).

    Collective: call it on every rank of a world of ``num_spatial_parts`` ranks (one process:
    ``num_spatial_parts=1``). ``options`` are :class:`InferJob` keywords (as ``dl.infer``'s; ``level`` and
    ``exclude_classes`` name ``slide_level`` and ``exclude_class`` too): ``level``,
    ``num_spatial_parts``, ``slice_method``, ``window``, ``dtype``, ``tissue_only``, ``min_tissue``, ``tissue`` (how
    tissue is judged: ``"saturation"`` or ``"otsu"``), ``map_mode`` (``"auto"``, the default: dense with a fully
    convolutional form, else tiles; or ``"dense"``, ``"tiles"``), ``batch_windows``, ``resume_outputs``,
    ``overwrite``, ``output_stride``, ``heat_class``, ``model`` (a family to refuse others; or the model object of a
    run built in Python, an nn.Module or its layer list), ``max_window_rows``, ``memory_budget``, ``overlay_side``,
    ``progress`` (default off), ``keep_trace`` (the per-rank timeline in ``summary["events"]``), ``mpp`` /
    ``magnification`` / ``source_mpp`` (resolution), ``task``, ``threshold``, ``min_area``, ``exclude_classes``
    (.geojson). Returns the summary (the command's JSON line) on rank 0, None on the other ranks; bad input raises
    ``ConfigError``/``ValueError``/``FileNotFoundError`` (``SetupFailed`` when one rank refused) on every rank.
    """
    outputs = [output] if isinstance(output, (str, Path)) else list(output)
    keywords = option_keywords({"progress": False, **options})
    keep_trace = bool(keywords.pop("keep_trace", False))
    network = keywords.pop("model", None)    # a family name to check against, or the model object itself
    if network is not None and isinstance(network, (str, Choice)):
        keywords["model"] = network
    job = replace(InferJob.from_keywords({"checkpoint": checkpoint, "slide": slide, "output": outputs, **keywords}),
                  keep_trace=keep_trace)
    trained = None if network is None or isinstance(network, (str, Choice)) else model_network(job, network)
    summary = SlideRunner(job, context(ctx, job), trained).run()
    return summary.as_dict() if summary is not None else None


def model_network(job: InferJob, model: object) -> TrainedNetwork:
    """The network of ``infer_slide(model=...)``: the model object a run built in Python, its weights taken from the
    job's checkpoint."""
    from torch import nn

    if not isinstance(model, nn.Module) and not (isinstance(model, (list, tuple))
                                                 and all(isinstance(m, nn.Module) for m in model)):
        raise TypeError(f"model: a family name, an nn.Module or a layer list, not a {type(model).__name__}")
    return load_network(str(job.checkpoint.path()), dtype=job.torch_dtype, output_stride=job.output_stride,
                        task=job.task, model=model)


def infer_slides(checkpoint: str | Path, slides: str | Path | Sequence[str | Path], output: str | Path, *,
                 ctx: Comm | None = None, **options: object) -> dict[str, object] | None:
    """Slide-level inference of a ``train --whole-slide`` checkpoint (``infer --slides A,B --output DIR``): one
    prediction per slide in ``output/slides.csv`` and, for attention/max heads, each slide's map (slide-aligned
    OME-TIFF and GeoJSON); see docs/inference.md, "Slide-level inference".

    ``slides``: slide paths, a folder, a list file or a cohort manifest ``FILE.csv`` (labels and patients joined).
    Collective over ``num_spatial_parts`` ranks (default 1: one process). ``options`` are :class:`InferJob` keywords
    that apply to a whole-slide model: ``num_spatial_parts``, ``slice_method``, ``dtype``, ``level``, ``mpp``,
    ``magnification``, ``source_mpp``, ``overwrite``, ``stain_normalize``. Returns the summary (slides, done, failed,
    the table's path) on rank 0, None elsewhere; bad input raises ``ConfigError``/``SetupFailed``.
    """
    source = ",".join(str(s) for s in slides) if not isinstance(slides, (str, Path)) else str(slides)
    job = InferJob.from_keywords({"checkpoint": checkpoint, "slides": source, "output": output,
                                  **option_keywords(options)})
    file = job.checkpoint.path()
    summary = run_slide_level(check_slide_level(job, file, readable_record(file)), context(ctx, job))
    return summary.as_dict() if summary is not None else None
