"""MPI: ZeRO levels 1-3 (cfg.zero_stage) == one process, float64, every feature that touches the optimizer step.

Usage: python -m tests.mpi.zero_exact [--backend=gloo] [--variants=V,...] CASE [CASE ...] (a layout of this world
size: ``tiles`` 2x2 tiles + a layer rank, 5 ranks; ``replicas`` 2 tiles x 2 data-parallel replicas + their layer
ranks, 6 ranks; ``tiles2`` 2 tiles + a layer rank, 3 ranks; ``se_tiles2`` the same with SE gates on the tiles). For
each CASE and each VARIANT (AdamW; SGD with momentum and gradient clipping to a global norm well below the gradients';
AdamW with 2-batch accumulation; AdamW with per-layer rate scales (``ScaledOptimizer``, layer decay's groups); AdamW
with the first layers frozen (LoRA's frozen base); SGD with clipping and accumulation under activation recomputation
(``checkpoint_activations='every'``); the model's BatchNorm always), the check ``<CASE> <VARIANT> zero <Z>`` for its
levels Z (``LEVELS``; 0 only for clipping): 4 steps whose losses and whole state (weights, BatchNorm statistics) equal
the serial run's within 1e-9 relative, on rank 0; and ``<CASE> checkpoint zero <Z>`` (Z = 2, 3): the optimizer state
gathered (``checkpoint/optimizer_state.py``) after 2 steps equals level 0's entry by entry within 1e-12, and an engine
at level Z loading it (and the weights) continues with level 0's losses. ``<CASE> state bytes``: at level 3 a rank
sharing a stage with n holders keeps at most 1.2 / n of level 0's (weights, gradients, optimizer state, buffers;
``measure/usage.state_bytes``): 0.3 on 4 tiles; and each sharded stage gathered its weights layer by layer
(``sharding/layer_units.py``), never more than its two largest layers' at once. Each variant's check also compares the
trained engine's evaluation (``evaluate_batch``) with the serial model's in eval mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.checkpoint.optimizer_state import gather_optimizer_state, load_optimizer_state
from mpi4dl_nb.measure.usage import state_bytes
from mpi4dl_nb.pipeline.layer_decay import ScaledOptimizer
from mpi4dl_nb.pipeline.optim import OptimizerKind, OptimizerSpec
from mpi4dl_nb.pipeline.reference import serial_reference
from tests.mpi.engine_exact import state_error
from tests.support.checks import Checks, run_checks
from tests.support.models import build, labels

RTOL = 1e-9
STEPS = 4
BATCH, IMAGE = 4, 16
CLIP = 1e-3     # far below the gradients' norm: every step clips
LAYOUTS = {
    "tiles": dict(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square", balance=(2, 3)),
    "replicas": dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", data_parallel=2,
                     balance=(2, 3)),
    "tiles2": dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", balance=(2, 3)),
    "se_tiles2": dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", balance=(3, 2)),
}
MODELS = {"se_tiles2": "se_resnet"}   # SE gates: parameters on replicated tensors, their gradient added by tile 0 only


def model_of(layout: str) -> str:
    return MODELS.get(layout, "resnet")
ADAMW = OptimizerSpec.of(OptimizerKind.ADAMW, 0.01)
SGD = OptimizerSpec.of(OptimizerKind.SGD, 0.1)


def scales(model: str) -> dict[str, float]:
    """A rate scale per whole-model key: 0.5 ** (layers after it), as layer decay's groups."""
    keys = [k for k, _ in nn.Sequential(*build(model)).named_parameters()]
    last = max(int(k.split(".")[0]) for k in keys)
    return {k: 0.5 ** (last - int(k.split(".")[0])) for k in keys}


# variant -> (optimizer spec, by name (layer-decay groups), accumulate, clip, frozen layers, recomputation)
VARIANTS: dict[str, tuple[OptimizerSpec, bool, int, float | None, int, str | None]] = {
    "adamw": (ADAMW, False, 1, None, 0, None),
    "sgd_clip": (SGD, False, 1, CLIP, 0, None),
    "accumulate": (ADAMW, False, 2, None, 0, None),
    "layer_decay": (ADAMW, True, 1, None, 0, None),
    "frozen": (ADAMW, False, 1, None, 1, None),
    "recompute": (SGD, False, 2, CLIP, 0, "every"),   # --checkpoint-activations every, with clipping and accumulation
}
# the levels each variant runs at (the suite's time; clipping at every level, 0 included): level 1 keeps whole
# gradients (its own clipping and accumulation paths), levels 2-3 the shards' (3 adds the weights gathered by layer)
LEVELS = {"adamw": (1, 2, 3), "sgd_clip": (0, 1, 2, 3), "accumulate": (1, 3), "layer_decay": (2,), "frozen": (3,),
          "recompute": (3,)}
CHECKPOINT_LEVELS = (2, 3)


def layers_of(model: str, frozen: int) -> list[nn.Module]:
    layers = build(model)
    for layer in layers[:frozen]:
        layer.requires_grad_(False)
    return layers


def data(model: str, seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen, dtype=torch.float64),
             labels(model, BATCH, IMAGE, gen)) for _ in range(count)]


def clipped(factory: Callable, max_norm: float | None) -> Callable:
    """``factory``'s optimizer whose step clips the gradients first (the serial reference of max_grad_norm)."""
    if max_norm is None:
        return factory

    def build_clipped(params):
        params = list(params)
        optimizer = factory(params)
        step = optimizer.step

        def clipped_step(*args, **kwargs):
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            return step(*args, **kwargs)
        optimizer.step = clipped_step
        return optimizer
    return build_clipped


def serial(layout: str, variant: str, batches) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    """The serial run's losses, state and evaluation logits on the first batch's images after training."""
    spec, named, accumulate, clip, frozen, _ = VARIANTS[variant]
    layers = layers_of(model_of(layout), frozen)
    keys = {id(p): k for k, p in nn.Sequential(*layers).named_parameters()}
    if named:
        decayed = ScaledOptimizer(spec, scales(model_of(layout)))
        factory = lambda params: decayed.by_name([(keys[id(p)], p) for p in params])  # noqa: E731
    else:
        factory = spec.build
    run = serial_reference(dl.ParallelConfig(**LAYOUTS[layout]), layers, batches, loss_fn=nn.CrossEntropyLoss(),
                           optimizer=clipped(factory, clip), accumulate=accumulate)
    state = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    with torch.no_grad():
        logits = run.model.eval()(batches[0][0])
    return run.losses, state, logits


def engine_of(ctx, layout: str, variant: str, level: int) -> dl.HybridEngine:
    spec, named, _, clip, frozen, recompute = VARIANTS[variant]
    cfg = dl.ParallelConfig(**LAYOUTS[layout], zero_stage=level, checkpoint_activations=recompute)
    factory = ScaledOptimizer(spec, scales(model_of(layout))) if named else spec.build
    return dl.HybridEngine(layers_of(model_of(layout), frozen), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                           optimizer=factory, max_grad_norm=clip)


def train(engine: dl.HybridEngine, batches, accumulate: int) -> list[float]:
    groups = [batches[i:i + accumulate] for i in range(0, len(batches), accumulate)]
    return [engine.train_accumulated(group) for group in groups]


def check_variant(ctx, layout: str, variant: str, level: int, want) -> str:
    accumulate = VARIANTS[variant][2]
    batches = data(model_of(layout), len(variant), STEPS * accumulate)
    engine = engine_of(ctx, layout, variant, level)
    common = [stage.common is not None for stage in engine.zero.stages.values()] if engine.zero else []
    if ctx.plane == "mpi" and level in (1, 2):   # holders on this one node map one copy of the whole weights
        assert all(common), f"levels 1-2 on one node: every shared stage's weights in common memory, {common}"
    losses = train(engine, batches, accumulate)
    evaluated = ctx.all_gather_object([(rows.start, out.detach().cpu()) for rows, out in
                                       engine.evaluate_batch(batches[0][0], batch_size=BATCH)])
    state = engine.full_state_dict()
    if ctx.rank != 0:
        return "rank 0 compares"
    want_losses, want_state, want_logits = want
    pairs = sorted((pair for outputs in evaluated for pair in outputs), key=lambda pair: pair[0])
    logits = torch.cat([out for _, out in pairs])
    state_error({"eval logits": logits}, {"eval logits": want_logits}, f"{layout} {variant} zero {level}", RTOL)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    if worst > RTOL:
        raise AssertionError(f"losses {losses} != serial {want_losses}")
    worst = max(worst, state_error(state, want_state, f"{layout} {variant} zero {level}", RTOL))
    return f"max rel err {worst:.2e}, weights in common memory: {sum(common)} of {len(common)} stages"


def check_checkpoint(ctx, layout: str, level: int) -> str:
    """Level Z's gathered optimizer state == level 0's; loading it into a level-Z engine continues level 0's run."""
    batches = data(model_of(layout), 7, 4)
    runs = {}
    for zero in (0, level):
        engine = engine_of(ctx, layout, "adamw", zero)
        train(engine, batches[:2], 1)
        runs[zero] = (engine, gather_optimizer_state(engine, ctx), engine.full_state_dict())
    base, saved, weights = runs[0]
    if ctx.rank == 0:
        theirs = runs[level][1]
        assert saved is not None and theirs is not None and sorted(saved) == sorted(theirs), "keys differ"
        for key, entry in saved.items():
            state_error({n: v for n, v in theirs[key].items() if isinstance(v, torch.Tensor)},
                        {n: v for n, v in entry.items() if isinstance(v, torch.Tensor)}, key, 1e-12)
    resumed = engine_of(ctx, layout, "adamw", level)
    resumed.load_full_state_dict(weights)
    load_optimizer_state(resumed, ctx, saved)
    want, got = train(base, batches[2:], 1), train(resumed, batches[2:], 1)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    if worst > RTOL:
        raise AssertionError(f"resumed at level {level}: losses {got} != level 0's {want}")
    return f"resumed losses max rel err {worst:.2e}"


def kept_bytes(engine: dl.HybridEngine) -> int:
    buffers = {id(b): b for inst in engine.instances.values() for b in inst.canonical.buffers()}
    return state_bytes(engine.trained_tensors(), engine.optimizer, buffers.values())


def check_state_bytes(ctx, layout: str) -> str:
    kept = {}
    for level in (0, 3):
        engine = engine_of(ctx, layout, "adamw", level)
        train(engine, data(model_of(layout), 3, 2), 1)
        kept[level] = kept_bytes(engine)
    assert engine.zero is not None
    peaks = gathered_peaks(engine.zero)
    holders = [stage.group.size for stage in engine.zero.stages.values()]
    shared = bool(holders)
    ratio = kept[3] / kept[0]
    if shared and ratio > 1.2 / min(holders):   # 0.3 over 4 tiles: a shard of everything, the buffers whole
        raise AssertionError(f"level 3 keeps {kept[3]} bytes, {ratio:.2f} of level 0's {kept[0]} over {holders}")
    if not shared and kept[3] != kept[0]:
        raise AssertionError(f"no shared stage, yet level 3 keeps {kept[3]} bytes, level 0 {kept[0]}")
    return f"level 3 / level 0: {kept[3]} / {kept[0]} bytes = {ratio:.3f}; gathered weights at most {peaks}"


def gathered_peaks(zero) -> str:
    """Each sharded stage gathered its weights layer by layer: the whole weights alive during the 2 steps never
    exceeded its two largest layers' (nor the whole stage's, gathered at once before layer by layer)."""
    found = []
    for index, stage in sorted(zero.stages.items()):
        two = sum(sorted(stage.unit_bytes)[-2:])
        if not stage.layered or len(stage.units) < 2 or stage.peak_bytes > two:
            raise AssertionError(f"stage {index}: layered {stage.layered}, units {stage.unit_bytes} bytes, "
                                 f"peak gathered {stage.peak_bytes} > {two}")
        found.append(f"stage {index} {stage.peak_bytes} of {sum(stage.unit_bytes)} bytes "
                     f"({len(stage.units)} layers)")
    return ", ".join(found) or "none shared"


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    ctx = dl.init(backend=options.get("backend", "auto"))
    chosen = options["variants"].split(",") if "variants" in options else list(VARIANTS)
    for layout in (a for a in sys.argv[1:] if not a.startswith("--")):
        for variant in chosen:
            accumulate = VARIANTS[variant][2]
            batches = data(model_of(layout), len(variant), STEPS * accumulate)
            want = serial(layout, variant, batches) if ctx.rank == 0 else None
            for level in LEVELS[variant]:
                with check(f"{layout} {variant} zero {level}") as result:
                    result.detail = check_variant(ctx, layout, variant, level, want)
        for level in CHECKPOINT_LEVELS:
            with check(f"{layout} checkpoint zero {level}") as result:
                result.detail = check_checkpoint(ctx, layout, level)
        with check(f"{layout} state bytes") as result:
            result.detail = check_state_bytes(ctx, layout)


if __name__ == "__main__":
    run_checks(main)
