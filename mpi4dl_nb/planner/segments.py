"""Per-segment activation recomputation in the memory model: one chunk of a stage run by
``pipeline/recompute.py`` (``checkpoint_activations`` 'every' | 'blocks' | N), from its layers'
footprints and the engine's own segment cut (``recompute.segment_bounds``).

* **forward** (no graph): each segment saves only its input (the first one is the stage
  input, which the runtime holds anyway); on spatial stages the ``replay.py`` log keeps every
  halo strip received and the BatchNorm statistics. A layer's peak without a graph is its
  peak with one less what it would have saved (its received strips stay).
* **between forward and backward**: the segment inputs but the first (``activations``), the
  logged strips and statistics (``halo``), the stage output.
* **backward**, last segment first: the segment's forward runs again with a graph from its
  saved input (no strip received: the log's), with the segment's output gradient alive, then
  back-propagates; the recomputed output stays alive until the segment's backward returns.
  The stage output, the received gradient and the logged strips stay alive to the end of the
  chunk's backward (the runtime holds the output; the autograd nodes hold the log); a
  segment's saved input goes once its backward ran.

The result is a ``StageFootprint`` whose ``retained``/``halo_kept`` are what the chunk holds
between forward and backward and whose backward peaks include the recomputation
(``recomputed``: the recomputed activations of the largest segment, for the breakdown).
"""

from __future__ import annotations

from collections.abc import Sequence

from .footprint import LayerFootprint, StageFootprint
from .stage_compose import compose_stage


def no_graph_peak(fp: LayerFootprint) -> int:
    """A layer's forward peak without a graph: what it saves for backward is freed once used
    (the received halo strips stay, logged for the recomputation)."""
    return max(fp.output_bytes, fp.forward_peak - (fp.kept - fp.halo_kept))


def recomputed_stage(stage: StageFootprint, segments: Sequence[tuple[int, int]],
                     grad_held: bool) -> StageFootprint:
    """``stage`` (composed from its layers) run segment by segment with recomputation.

    ``segments``: half-open layer ranges (``recompute.segment_bounds``); ``grad_held``: the
    output gradient is a received buffer held for the whole backward (every stage but the last).
    """
    layers = stage.layers
    if not layers or segments[0][0] != 0 or segments[-1][1] != len(layers):
        raise ValueError(f"segments {list(segments)} do not cover the stage's {len(layers)} layers")
    logs = [fp.replay_log for fp in layers]
    starts = [start for start, _ in segments]
    # inputs saved by the segments before and including each one (the stage input excluded)
    saved_upto = []
    total = 0
    for k, start in enumerate(starts):
        total += layers[start].input_bytes if k > 0 else 0
        saved_upto.append(total)

    forward_peak = logged = 0
    segment = 0
    for j, fp in enumerate(layers):
        at_start = j in starts
        segment += int(at_start and j > 0)
        alive_input = 0 if at_start else fp.input_bytes
        forward_peak = max(forward_peak, saved_upto[segment] + logged + alive_input + no_graph_peak(fp))
        logged += logs[j]

    # alive through the whole backward of the chunk: the logged strips, the stage output, the gradient
    common = logged + stage.output_bytes + (stage.output_bytes if grad_held else 0)
    first = later = recomputed = grads_after = 0
    for k in range(len(segments) - 1, -1, -1):
        start, stop = segments[k]
        part = layers[start:stop]
        last = k == len(segments) - 1
        redo = compose_stage(part, grad_held=grad_held or not last, output_held=True)
        in_log = sum(fp.halo_kept for fp in part)         # the recomputation reuses the logged strips
        base = common + saved_upto[k] - in_log
        gradient = redo.output_bytes if not last else 0   # the segment's output gradient, already made
        twice = redo.output_bytes if last and grad_held else 0   # the received gradient, in ``common``
        forward = base + gradient + redo.forward_peak
        first = max(first, forward + grads_after, base + redo.backward_first - twice + grads_after)
        later = max(later, forward, base + redo.backward_later - twice)
        recomputed = max(recomputed, redo.retained - in_log)
        grads_after += redo.grad_bytes

    kept = [logs[j] + (layers[j + 1].input_bytes if j + 1 in starts else 0) for j in range(len(layers))]
    return StageFootprint(
        input_bytes=stage.input_bytes, output_bytes=stage.output_bytes, forward_peak=forward_peak,
        retained=saved_upto[-1] + logged + stage.output_bytes, kept_by_layer=tuple(kept), halo_kept=logged,
        backward_first=first, backward_later=later, input_grad_bytes=stage.input_grad_bytes,
        grad_bytes=stage.grad_bytes, persistent=stage.persistent, layers=layers, recomputed=recomputed)
