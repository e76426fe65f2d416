"""A stage's footprint for one chunk, composed from its layers' (``compose_stage``)."""

from __future__ import annotations

from collections.abc import Sequence

from .footprint import LayerFootprint, SplitStage, StageFootprint


def compose_stage(layers: Sequence[LayerFootprint], grad_held: bool = False,
                  output_held: bool = False, split: bool = False) -> StageFootprint:
    """One chunk of a stage from its layers' footprints: between two layers the hand-on tensor is kept if the
    producer or the consumer saved it for backward; during a layer's forward its input is alive; during its
    backward everything the earlier layers kept is alive.

    ``grad_held``: the output gradient is a received buffer the runtime keeps for the
    whole backward of the stage (every stage but the last), not one freed once used;
    ``output_held``: the output too stays alive for the whole backward (a recomputed
    segment's output, held by the backward that recomputed it); ``split``: the stage's
    backward is split (``SplitStage``, from layers simulated with ``split=True``).
    """
    count = len(layers)
    if count == 0:
        raise ValueError("a stage needs at least one layer")
    # hand-on tensor after layer k kept until backward: saved by its producer or consumer;
    # the stage output (last layer) is held by the runtime until the chunk's backward.
    keeps = [layers[k].saves_output or (k + 1 < count and layers[k + 1].saves_input) or k == count - 1
             for k in range(count)]
    kept = [fp.kept + (fp.output_bytes if keep else 0) for fp, keep in zip(layers, keeps)]
    forward_peak = 0
    before = 0                              # kept by the layers before the running one
    for k, fp in enumerate(layers):
        alive_input = layers[k - 1].output_bytes if k > 0 and not keeps[k - 1] else 0
        forward_peak = max(forward_peak, before + alive_input + fp.forward_peak)
        before += kept[k]
    grads_after = 0
    first = later = 0
    for k in range(count - 1, -1, -1):
        fp = layers[k]
        earlier = sum(kept[:k])
        # backward_peak counts the layer's output as alive: during the layer's backward it
        # is only if the layer saved it or it is the stage output (held by the runtime);
        # a consumer's saved copy went with the consumer's backward
        alive = fp.saves_output or k == count - 1
        own = fp.backward_peak - (0 if alive else fp.output_bytes)
        if k < count - 1:   # the held output gradient, the held output
            own += layers[-1].output_bytes * (int(grad_held) + int(output_held))
        # the layer's own parameter gradients are inside backward_peak: for a later
        # chunk they are the accumulation temporaries, the resident ones counted outside
        first = max(first, earlier + own + grads_after)
        later = max(later, earlier + own)
        grads_after += fp.grad_bytes
    return StageFootprint(
        input_bytes=layers[0].input_bytes, output_bytes=layers[-1].output_bytes,
        forward_peak=forward_peak, retained=sum(kept), kept_by_layer=tuple(kept),
        halo_kept=sum(fp.halo_kept for fp in layers), backward_first=first, backward_later=later,
        input_grad_bytes=layers[0].input_grad_bytes, grad_bytes=sum(fp.grad_bytes for fp in layers),
        persistent=sum(fp.persistent for fp in layers), layers=tuple(layers),
        split=_split_stage(layers, keeps, kept, grad_held) if split else None)


def _split_stage(layers: Sequence[LayerFootprint], keeps: Sequence[bool], kept: Sequence[int],
                 grad_held: bool) -> SplitStage | None:
    """The stage's ``SplitStage`` from its layers' ``SplitTerms`` (None: no parameters, nothing split).

    I is one ``autograd.grad`` over the stage with the graph retained: while layer k's part runs, every
    tensor the forward kept is alive, with the output gradients kept by the layers after k (and the
    received gradient). Once I is over only the nodes after the stage's last parameter module go (nothing
    else references them), each layer before keeps its whole graph for W."""
    if not any(fp.grad_bytes for fp in layers):
        return None
    count, retained = len(layers), sum(kept)
    # the received gradient, unless the last layer keeps it for W (then in its kept); its own input_peak counts it
    received = max(0, layers[-1].output_bytes - layers[-1].split.kept_received) if grad_held else 0
    input_peak = after = 0
    for k in range(count - 1, -1, -1):
        input_peak = max(input_peak, retained + (received if k < count - 1 else 0) + after
                         + layers[k].split.input_peak)
        after += layers[k].split.kept
    released = 0
    for k in range(count - 1, -1, -1):
        fp = layers[k]
        if fp.grad_bytes:   # the last layer with parameters: its nodes after its last parameter module
            released += fp.split.released - (0 if keeps[k] else fp.output_bytes)
            break
        released += kept[k]
    return SplitStage(input_peak=input_peak, held=max(0, retained - released), kept=after,
                      keeps_input=layers[0].saves_input,
                      weight_peak=max(fp.split.weight_peak for fp in layers))
