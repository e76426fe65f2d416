"""timm vision transformers on tiles equal one process (issue 52's first acceptance block, a MAP head), and refusals.

Float64, batch 2, timm's own initialisation (seeded) with LayerScale, class/register tokens and position
embeddings redrawn at unit scale (so the blocks and the prefix tokens matter to the output), in training mode:
output, input gradient, every parameter gradient (tile shares summed by ``reduce_tile_gradients``), then an eval
forward; the output is the model's output on every rank, bitwise equal across ranks. Each model's serial
reference runs on one rank (model i on rank i mod 4). Models are built with ``depth=2`` (the same block code as
at full depth, 12-14 blocks); ``MPI4DL_VIT_FULL_DEPTH=1`` builds them at full depth.

The hybrid (R26 backbone, stride 32, on tiles with halos) runs at 256 px, batch 1 (8x8 tokens; 448 px, batch 2
at full depth).

Issue 52's trace and memory acceptance on the same launch: a depth-2 ViT-S/16 on 2x2 tiles, traced, posts every
layer's next key/value block before the current block's attention starts (``trace_check``); ViT-S/16 at 1024 px
(4,097 tokens), float32, batch 1, depth 1 (the patch embedding, one block, the head: the block's share asserted apart)
on P = 4 (2x2) and P = 2 (1x2, ranks 0-1, beside the one-process references on ranks 2-3): what a rank holds after
the forward (saved for backward and the output, an allocation profiler's live bytes) at most 1.15/P of one process
with blockwise attention of the ring's block size, the peak of forward + backward at most that plus the ring's blocks
in flight, no N x N matrix (``memory_checks``); the planner's peak for ViT-S/16 at 512 px (depth 1) on P = 4 and 2
within 15% of the measured training step on every rank (``planner_check``). They add about 9 CPU-s per rank.

Issue 52's "mixed with the rest" (``python -m tests.mpi.vit_exact mixed``, on 4, 5 and 6 ranks: jobs of the shared
launches of those sizes): a tiny ViT (32 wide, 3 blocks, 8-px patches at 32 px, a class and a register token) cut as
``--model timm:...`` cuts it, its embedding and first block on token tiles, the rest on layer stages, trained 2
SGD-momentum steps by ``HybridEngine`` in float64 with 2 data-parallel copies of the layer stage (local_dp, 4 ranks),
2 data-parallel replicas under GPipe (6 ranks), GEMS under 1F1B, zb1, zbv and interleaved with every block recomputed
(5 ranks, 2x2 tiles): losses (1e-9 relative) on every rank and every rank's copies of its stages equal one process
(engine_exact's rule); in bf16 (1F1B), the CNN path's bf16 rule (tests/support/bf16_rule.py) against one process
under the same autocast. Recomputation under 1F1B through the CLI: tests/mpi/byom_exact.py. About 1 CPU-s per rank,
and timm's import (2.7 CPU-s) on the 6 ranks (no other job of that launch imports it).

Usage: python -m tests.mpi.vit_exact [mixed]   (4 ranks: the 2x2 and the 1x4 grid in one launch; ``mixed``: 4, 5 or 6)
Named checks: ``check_names()``; with ``mixed``, ``mixed_names(world size)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError, ParallelConfig
from mpi4dl_nb.pipeline.engine import HybridEngine
from mpi4dl_nb.planner.attention import TokenGrid, ring_cost
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles
from mpi4dl_nb.spatial.tokens.blockwise import blockwise_attention
from tests.support.allocations import ActivationProfile, profile_activations
from tests.support.bf16_rule import pin_bf16_kernels
from tests.support.checks import Checks, run_checks
from tests.support.exactness import exact_and_equal_on_every_rank

RTOL = 1e-10
FULL_DEPTH = os.environ.get("MPI4DL_VIT_FULL_DEPTH") == "1"


GRIDS = ((2, 2), (1, 4))
HYBRID_SIZE, HYBRID_BATCH = (448, 2) if FULL_DEPTH else (256, 1)


def models(rows: int, cols: int) -> dict[str, tuple[str, int, dict[str, Any]]]:
    """Check label -> (timm name, image size, create_model keywords) for the grid ``rows x cols``."""
    patch16 = 224 if (rows, cols) == (2, 2) else 256
    dinov2: dict[str, Any] = {"img_size": 224} if (rows, cols) == (2, 2) else \
        {"img_size": 518, "dynamic_img_size": True}   # 37x37 position embedding resampled to 16x16
    learned_rope = {} if (rows, cols) == (2, 2) else {   # a learned rope (RotaryEmbeddingMixed, float32 inside)
        "vit_small_patch16_rope_mixed_224": ("vit_small_patch16_rope_mixed_224", 256, {"img_size": 256})}
    return {
        **learned_rope,
        "vit_small_patch16_224": ("vit_small_patch16_224", patch16, {"img_size": patch16}),
        "vit_little_patch16_reg4_gap_256": ("vit_little_patch16_reg4_gap_256", 256, {"num_classes": 0}),
        "vit_small_patch14_reg4_dinov2": ("vit_small_patch14_reg4_dinov2", 224, dinov2),
        "vit_small_patch16_rope_224": ("vit_small_patch16_rope_224", patch16, {"img_size": patch16}),
        "vit_small_patch16_224 with a MAP head": ("vit_small_patch16_224", patch16,
                                                  {"img_size": patch16, "global_pool": "map"}),
        "vit_small_r26_s32_224": ("vit_small_r26_s32_224", HYBRID_SIZE, {"img_size": HYBRID_SIZE}),
    }


def build(name: str, seed: int, **kwargs: Any) -> torch.nn.Module:
    import timm

    torch.manual_seed(seed)
    depth = {} if FULL_DEPTH else {"depth": 2}
    model = timm.create_model(name, pretrained=False, num_classes=kwargs.pop("num_classes", 10), **depth, **kwargs)
    model = model.double()
    with torch.no_grad():   # unit-scale LayerScale, prefix tokens and position embeddings
        for pname, p in model.named_parameters():
            if pname.endswith(("gamma", "gamma_1", "gamma_2")) or pname in ("cls_token", "reg_token", "pos_embed",
                                                                              "attn_pool.latent"):
                p.copy_(torch.rand_like(p) + 0.5 if "gamma" in pname else torch.randn_like(p))
    return model


def exact_name(rows: int, cols: int, model: str) -> str:
    return f"{rows}x{cols}: {model} equals one process"


Call = Callable[[torch.nn.Module, torch.Tensor], object]
REFUSALS: dict[str, tuple[Callable[[int, int], torch.nn.Module], str, Call | None]] = {}


def refusal(label: str, needle: str, call: Call | None = None) -> Callable[..., Any]:
    """Register a model refused by ``spatialize`` (or, with ``call``, at its first forward on 256 x 256 px)."""
    def register(make: Callable[[int, int], torch.nn.Module]) -> Callable[[int, int], torch.nn.Module]:
        REFUSALS[label] = (make, needle, call)
        return make
    return register


@refusal("a grid that cuts a patch", "sizes that work")
def _cut(rows: int, cols: int) -> torch.nn.Module:
    return build("vit_small_patch16_224", 0, img_size=240 if rows == 2 else 224)   # 15 or 14 tokens: uneven


@refusal("a max pool over the tokens (global_pool='max')", "global_pool='max'")
def _max(rows: int, cols: int) -> torch.nn.Module:
    return build("vit_small_patch16_224", 0, img_size=256, global_pool="max")


@refusal("a block whose attention mixes tokens otherwise (ParallelScalingBlock)", "blocks.0",
         lambda net, x: net(x))
def _parallel(rows: int, cols: int) -> torch.nn.Module:
    from timm.models.vision_transformer import ParallelScalingBlock

    return build("vit_small_patch16_224", 0, img_size=256, block_fn=ParallelScalingBlock)


@refusal("an attention mask", "attn_mask",
         lambda net, x: net(x, attn_mask=torch.ones(1, 1, 257, 257, dtype=torch.bool)))
def _masked(rows: int, cols: int) -> torch.nn.Module:
    return build("vit_small_patch16_224", 0, img_size=256)


@refusal("DeiT's distilled ViT (a subclass with its own forward)", "VisionTransformerDistilled")
def _distilled(rows: int, cols: int) -> torch.nn.Module:
    return build("deit_tiny_distilled_patch16_224", 0, img_size=256)


@refusal("BEiT (another transformer class: its patch embedding)", "'patch_embed' (PatchEmbed)")
def _beit(rows: int, cols: int) -> torch.nn.Module:
    return build("beit_base_patch16_224", 0, img_size=256)


def refusal_name(rows: int, cols: int, label: str) -> str:
    return f"{rows}x{cols}: refuses {label}"


def check_names() -> list[str]:
    return [exact_name(rows, cols, m) for rows, cols in GRIDS for m in models(rows, cols)] + \
        [refusal_name(rows, cols, label) for rows, cols in GRIDS for label in REFUSALS] + \
        memory_names() + [trace_name(), planner_name()]


def check_model(ctx: Context, grid: TileGrid, index: int, name: str, size: int, kwargs: dict[str, Any]) -> str:
    """One model on ``grid`` against one process (on rank ``index`` mod 4); the outputs bitwise equal on every rank."""
    model = build(name, index, **kwargs)
    torch.manual_seed(100 + index)
    x = torch.randn(HYBRID_BATCH if "r26" in name else 2, 3, size, size, dtype=torch.float64)
    return exact_and_equal_on_every_rank(model, grid, x, ctx, what=name, rtol=RTOL,
                                         reference_rank=index % ctx.world_size)


def check_refusal(ctx: Context, grid: TileGrid, label: str) -> str:
    make, needle, call = REFUSALS[label]
    try:
        net = spatialize(make(grid.rows, grid.cols), grid, ctx)
        if call is not None:
            call(net, scatter_tiles(torch.zeros(1, 3, 256, 256, dtype=torch.float64), grid, ctx))
    except ConfigError as error:
        assert needle in str(error), f"{needle!r} not in: {error}"
        return str(error)[:200]
    raise AssertionError("not refused")

# ---------------------------------------------------------------------------------------------------- trace
TRACE_LAYERS = ("blocks.0.attn", "blocks.1.attn")


def trace_name() -> str:
    return "2x2: every layer's ring posts each next key/value block before the current block's attention ends"


def trace_check(ctx: Context) -> str:
    """A depth-2 ViT-S/16 on 2x2 tiles, one forward + backward traced: in every layer's ring (its events carry the
    attention module's name), for each pass and each step that passes a block on, the ``ring_send`` of the next
    block is stamped before the step's ``ring_block`` (its attention) starts, hence before it ends; every step
    computes once; each layer's gradient accumulators make ``P`` hops."""
    model = build("vit_small_patch16_224", 7, img_size=256)
    grid = TileGrid(2, 2)
    net = spatialize(model, grid, ctx)
    x = torch.randn(1, 3, 256, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    start = ctx.tracer.recorded
    net(scatter_tiles(x, grid, ctx)).sum().backward()
    events = [e for e in ctx.tracer.since(start) if e.op.startswith("ring_")]
    assert {e.extra["layer"] for e in events} == set(TRACE_LAYERS), {e.extra["layer"] for e in events}
    size, checked = ctx.world_size, 0
    for layer in TRACE_LAYERS:
        mine = [e for e in events if e.extra["layer"] == layer]
        for what in ("forward", "backward"):
            sends = {int(str(e.extra["step"])): e for e in mine if e.op == "ring_send" and e.extra["what"] == what}
            blocks = [e for e in mine if e.op == "ring_block" and e.extra["what"] == what]
            assert sorted(int(str(e.extra["step"])) for e in blocks) == list(range(size)), (layer, what, blocks)
            assert sorted(sends) == list(range(size - 1)), (layer, what, sorted(sends))
            for block in blocks:
                send = sends.get(int(str(block.extra["step"])))
                if send is not None:
                    assert send.start <= block.start < block.end and send.start < block.end, \
                        f"{layer} {what} step {block.extra['step']}: posted at {send.start:.6f}, attention " \
                        f"{block.start:.6f}..{block.end:.6f}"
                    checked += 1
        hops = [e for e in mine if e.op == "ring_send" and e.extra["what"] == "gradient"]
        assert len(hops) == size - 1, f"{layer}: {len(hops)} gradient hops, want {size - 1} (the own share stays)"
    return f"{checked} key/value posts in {len(TRACE_LAYERS)} layers, each before its step's attention started"


# --------------------------------------------------------------------------------------------------- memory
MEMORY_SIZE, MEMORY_DEPTH, BOUND = 1024, 1, 1.15
MEMORY_TOKENS = (MEMORY_SIZE // 16) ** 2 + 1              # N: 4,096 image tokens and the class token
MEMORY_RINGS = {4: (TileGrid(2, 2), (0, 1, 2, 3)), 2: (TileGrid(1, 2), (0, 1))}
REFERENCE_RANKS = {2: 2, 4: 3}      # one process, blockwise attention of the ring's block size, beside the P=2 ring
MEASURED = ("blocks.0",)            # the modules whose held bytes are compared one by one


def memory_name(parts: int) -> str:
    return (f"ViT-S/16 at {MEMORY_SIZE} px ({MEMORY_TOKENS:,} tokens) on P={parts}: activation bytes per rank at "
            f"most {BOUND}/P of one process with blockwise attention, no N x N matrix")


def memory_names() -> list[str]:
    return [memory_name(parts) for parts in MEMORY_RINGS]


class _Blockwise(TorchFunctionMode):
    """One process: scaled_dot_product_attention as ``blockwise_attention`` with ``block`` keys at a time."""

    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block

    def __torch_function__(self, func: Callable[..., Any], types: object, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        assert kwargs.get("attn_mask") is None and not kwargs.get("dropout_p"), kwargs
        q, k, v = args[:3]
        return blockwise_attention(q, k, v, self.block, scale=kwargs.get("scale"))


def vit_s(depth: int = MEMORY_DEPTH, size: int = MEMORY_SIZE) -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=size, depth=depth, num_classes=10)


def ring_block(parts: int) -> int:
    """The largest ring member's tokens: the block one process takes its keys in, to compare like with like."""
    return -(-(MEMORY_TOKENS - 1) // parts) + 1


def one_process_profile(x: torch.Tensor, parts: int) -> ActivationProfile:
    """One process on the whole image, its attention blockwise with P-ring's block size."""
    serial = vit_s()
    with _Blockwise(ring_block(parts)):
        return profile_activations(serial, lambda: serial(x), MEASURED)


def memory_profiles(ctx: Context, rings: dict[int, Any]) -> dict[str, ActivationProfile]:
    """This rank's profiles: ``P=4`` (every rank), then ``P=2`` (ranks 0, 1) beside one process with P=2's and
    P=4's block size (ranks 2 and 3); float32, batch 1, the same image on every rank."""
    x = torch.randn(1, 3, MEMORY_SIZE, MEMORY_SIZE, generator=torch.Generator().manual_seed(3))
    mine: dict[str, ActivationProfile] = {}
    for parts, (grid, ranks) in MEMORY_RINGS.items():
        if ctx.rank in ranks:
            net = spatialize(vit_s(), grid, ctx, rings[parts])
            tile = scatter_tiles(x, grid, ctx, rings[parts])
            mine[f"P={parts}"] = profile_activations(net, partial(net, tile), MEASURED)
        elif parts == 2:
            reference = next(p for p, rank in REFERENCE_RANKS.items() if rank == ctx.rank)
            mine[f"one process, block {reference}"] = one_process_profile(x, reference)
        ctx.barrier()
    return mine


def check_memory(ring: ActivationProfile, one: ActivationProfile, parts: int, member: int) -> str:
    """What stays held after the forward (saved for backward and the output) and the first block's share of it at
    most BOUND/P of one process's; the peak of forward + backward at most BOUND/P of one process's plus the ring's
    blocks in flight (not activations: the held and arriving key/value block and gradient accumulator,
    ``planner.attention.ring_cost``); no op made a matrix of N x N elements or an N-square."""
    ratios = {"held": (ring.held, one.held), **{name: (ring.held_by[name], one.held_by[name]) for name in MEASURED}}
    over = {k: f"{a / b:.3f}" for k, (a, b) in ratios.items() if a > BOUND / parts * b}
    assert not over, f"more than {BOUND}/{parts} of one process: {over}"
    grid, _ = MEMORY_RINGS[parts]
    counts = TokenGrid(MEMORY_SIZE // 16, MEMORY_SIZE // 16, prefix=1).member_tokens(grid)
    in_flight = ring_cost(counts, member, 384, 6, 4).in_flight_backward
    assert ring.peak <= BOUND / parts * one.peak + in_flight, \
        f"peak {ring.peak / one.peak:.3f} of one process's, {in_flight / one.peak:.3f} of it in flight"
    rows, cols = ring.largest_matrix
    assert rows * cols < MEMORY_TOKENS ** 2 and ring.largest_square < MEMORY_TOKENS, \
        f"a {rows} x {cols} matrix, a {ring.largest_square}-square (N = {MEMORY_TOKENS})"
    assert ring.largest_numel < MEMORY_TOKENS ** 2, \
        f"a tensor of {ring.largest_numel:,} elements, N x N = {MEMORY_TOKENS ** 2:,} (all heads' scores at once?)"
    mb = 2 ** 20
    return ", ".join(f"{k} {a / mb:.1f}/{b / mb:.1f} MB ({a / b:.3f})" for k, (a, b) in ratios.items()) + \
        f" <= {BOUND / parts:.3f}; peak {ring.peak / mb:.1f}/{one.peak / mb:.1f} MB ({ring.peak / one.peak:.3f}, " \
        f"{in_flight / one.peak:.3f} of it in flight); largest matrix {rows} x {cols}, largest square " \
        f"{ring.largest_square} (one process {one.largest_square}), largest tensor {ring.largest_numel:,} elements"


def recorder_sees_full_scores() -> None:
    """Positive control: timm's non-fused attention on 257 tokens (a ViT 48 wide: its weights are smaller) makes
    (and the profile sees) 257 x 257 scores."""
    import timm

    model = timm.create_model("vit_small_patch16_224", img_size=256, depth=1, embed_dim=48, num_heads=2)
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False   # type: ignore[assignment]
    x = torch.randn(1, 3, 256, 256)
    assert profile_activations(model, lambda: model(x)).largest_square == 257


def memory_checks(check: Checks, ctx: Context) -> None:
    rings = {parts: ctx.new_group(ranks) for parts, (_, ranks) in MEMORY_RINGS.items()}
    planner_check(check, ctx, rings)
    everyone = ctx.all_gather_object(memory_profiles(ctx, rings))
    for parts, (_, ranks) in MEMORY_RINGS.items():
        if ctx.rank in ranks:
            with check(memory_name(parts)) as result:
                recorder_sees_full_scores()
                one = everyone[REFERENCE_RANKS[parts]][f"one process, block {parts}"]
                result.detail = check_memory(everyone[ctx.rank][f"P={parts}"], one, parts, ranks.index(ctx.rank))



# -------------------------------------------------------------------------------------------------- planner
PLAN_SIZE, PLAN_BOUND = 512, 0.15


def planner_name() -> str:
    return (f"ViT-S/16 at {PLAN_SIZE} px on P=4 and P=2: the planner's peak within {PLAN_BOUND:.0%} of the measured "
            f"training step on every rank")


def measured_step(ctx: Context, parts: int, group: Any) -> int:
    """Peak bytes of one SGD-with-momentum step (after a warm-up step) of ViT-S/16 depth 1 on this rank's tile."""
    from mpi4dl_nb.planner import measure_step_memory
    from mpi4dl_nb.spatial.convert import reduce_tile_gradients

    grid, _ = MEMORY_RINGS[parts]
    model = planned_vit()
    net = spatialize(model, grid, ctx, group)
    x = torch.randn(1, 3, PLAN_SIZE, PLAN_SIZE, generator=torch.Generator().manual_seed(5))
    tile, label = scatter_tiles(x, grid, ctx, group), torch.tensor([1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:   # the all-reduce's buckets, as the engine the planner models sums (not the node's window)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(tile), label).backward()
        reduce_tile_gradients(net, shared_memory=False)
        opt.step()

    return measure_step_memory(step, [model], opt, warmup=step)


def planned_vit() -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=PLAN_SIZE, depth=1, num_classes=2,
                             dynamic_img_size=True)


def planned_step(parts: int) -> list[int]:
    """The planner's peak per tile of ``parts`` for that step (the spatial stage alone, as ``dl.spatialize`` runs
    it), less the engine's gradient buckets (the engine sums tile gradients in buckets; ``reduce_tile_gradients``
    does not keep them)."""
    import timm

    from mpi4dl_nb import ParallelConfig, planner
    from tests.planner.test_planner_attention import vit_layers

    layers = vit_layers(timm, depth=1, size=PLAN_SIZE)
    cfg = ParallelConfig(split_size=1, spatial_size=1, num_spatial_parts=parts,
                         slice_method="square" if parts == 4 else "vertical")
    plan = planner.estimate_memory(layers, cfg, PLAN_SIZE, 1)
    return [rank.total - rank.buckets for rank in plan.ranks]


def planner_check(check: Checks, ctx: Context, rings: dict[int, Any]) -> None:
    """Measured on every rank of the P=4 ring, then of the P=2 ring while ranks 2 and 3 plan both."""
    mine: dict[str, object] = {"P=4": measured_step(ctx, 4, rings[4])}
    ctx.barrier()
    if ctx.rank in (0, 1):
        mine["P=2"] = measured_step(ctx, 2, rings[2])
    else:
        mine[f"plan P={2 if ctx.rank == 2 else 4}"] = planned_step(2 if ctx.rank == 2 else 4)
    everyone = ctx.all_gather_object(mine)
    plans = {2: everyone[2]["plan P=2"], 4: everyone[3]["plan P=4"]}
    with check(planner_name()) as result:
        ratios = {f"P={parts} rank {rank}": plans[parts][rank] / everyone[rank][f"P={parts}"]   # type: ignore
                  for parts in (4, 2) for rank in range(parts)}
        assert all(abs(r - 1) < PLAN_BOUND for r in ratios.values()), ratios
        result.detail = "estimate/measured " + ", ".join(f"{k} {r:.3f}" for k, r in ratios.items())


# ---------------------------------------------------------------------------------------------------- mixed
MIXED_SIZE, MIXED_STEPS, MIXED_RTOL = 32, 2, 1e-9
SQUARE: dict[str, Any] = {"spatial_size": 1, "num_spatial_parts": 4}                                # 2x2 token tiles
VERTICAL: dict[str, Any] = {"spatial_size": 1, "num_spatial_parts": 2, "slice_method": "vertical"}  # 1x2 token tiles
MIXED: dict[str, tuple[dict[str, Any], int]] = {   # label -> ParallelConfig keywords, global batch
    "2 data-parallel replicas of 1x2 tiles + a layer rank, GPipe over 2 micro-batches": (
        {"split_size": 2, **VERTICAL, "data_parallel": 2, "parts": 2, "schedule": "gpipe", "balance": (2, 3)}, 4),
    "1x2 tiles + 2 data-parallel copies of the layer stage (local_dp)": (
        {"split_size": 2, **VERTICAL, "local_dp": 2, "balance": (2, 3)}, 4),
    "GEMS (both directions, 1F1B over 2 micro-batches) on 2x2 tiles + a layer rank": (
        {"split_size": 2, **SQUARE, "times": 1, "parts": 2, "schedule": "1f1b", "balance": (2, 3)}, 4),
    "zero bubble zb1 on 2x2 tiles + a layer rank": ({"split_size": 2, **SQUARE, "parts": 2, "schedule": "zb1",
                                                     "balance": (2, 3)}, 4),
    "zero bubble zbv on 2x2 tiles + a layer rank (tile 0 holds the head)": (
        {"split_size": 4, **SQUARE, "parts": 2, "schedule": "zbv", "balance": (2, 1, 1, 1)}, 4),
    "interleaved (2 virtual stages), every block recomputed, on 2x2 tiles + a layer rank": (
        {"split_size": 4, **SQUARE, "parts": 2, "schedule": "interleaved", "virtual_stages": 2,
         "balance": (2, 1, 1, 1), "checkpoint_activations": "every"}, 4),
}
BF16: dict[str, Any] = {"split_size": 2, **SQUARE, "parts": 2, "schedule": "1f1b", "balance": (2, 3)}


def mixed_name(label: str) -> str:
    return f"a ViT's embedding and first block on tiles, the rest on layer stages: {label} equals one process"


def bf16_name() -> str:
    return "a ViT's spatial stage + a layer rank in bf16 (1F1B) is as close to one process under autocast as fp32"


def mixed_names(world_size: int) -> list[str]:
    """The mixed checks a ``mixed`` job of ``world_size`` ranks runs."""
    names = [mixed_name(label) for label, (kwargs, _) in MIXED.items()
             if ParallelConfig(**kwargs).world_size == world_size]
    return names + ([bf16_name()] if ParallelConfig(**BF16).world_size == world_size else [])


def tiny_vit_layers(dtype: torch.dtype = torch.float64) -> list[torch.nn.Module]:
    """A ViT 32 wide, 3 blocks, 8-px patches (4x4 tokens at 32 px), a class and a register token, cut into
    pieces (embedding, 3 blocks, head) as ``--model timm:...`` cuts it; prefix tokens and positions at unit scale."""
    import timm

    from mpi4dl_nb.models.vit import token_pieces

    torch.manual_seed(11)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=MIXED_SIZE, patch_size=8,
                              embed_dim=32, num_heads=2, depth=3, reg_tokens=1, num_classes=3)
    with torch.no_grad():
        for name in ("cls_token", "reg_token", "pos_embed"):
            getattr(model, name).normal_()
    return [layer.to(dtype) for layer in token_pieces(model)]


def mixed_data(batch: int, dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(batch)
    return [(torch.randn(batch, 3, MIXED_SIZE, MIXED_SIZE, generator=gen, dtype=dtype),
             torch.randint(0, 3, (batch,), generator=gen)) for _ in range(MIXED_STEPS)]


def mixed_sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_mixed(ctx: Context, cfg: ParallelConfig, data: list[tuple[torch.Tensor, torch.Tensor]],
                dtype: torch.dtype = torch.float64) -> tuple[list[float], HybridEngine]:
    """The engine on the tiny ViT's pieces (refused first as ``train`` refuses): losses, the engine."""
    from mpi4dl_nb.models.vit import refuse_token_spatial_stage

    layers = tiny_vit_layers(dtype)
    refuse_token_spatial_stage(layers, cfg, MIXED_SIZE)
    engine = HybridEngine(layers, cfg, ctx, loss_fn=torch.nn.CrossEntropyLoss(), optimizer=mixed_sgd,
                          image_size=MIXED_SIZE)
    return [engine.train_step(x, y) for x, y in data], engine


def one_process(cfg: ParallelConfig,
                data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The serial reference (the engine's micro-batch chunks, gradient accumulation): its losses and state."""
    from mpi4dl_nb.pipeline.reference import serial_reference

    run = serial_reference(cfg, tiny_vit_layers(), data, loss_fn=torch.nn.CrossEntropyLoss(), optimizer=mixed_sgd)
    return run.losses, run.state_dict()


class _Autocast(torch.nn.Module):
    """A model whose forward runs under bf16 autocast (its backward after, outside it: as the engine's)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out: torch.Tensor = self.model(*args)
            return out


def one_process_float32(cfg: ParallelConfig, data: list[tuple[torch.Tensor, torch.Tensor]],
                        autocast: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The serial reference of the float32 model, its forward and loss under bf16 autocast or not."""
    from mpi4dl_nb.pipeline.reference import serial_chunks, serial_step

    model, loss = torch.nn.Sequential(*tiny_vit_layers(torch.float32)), torch.nn.CrossEntropyLoss()
    net, loss_fn = (_Autocast(model), _Autocast(loss)) if autocast else (model, loss)
    optimizer, chunks = mixed_sgd(model.parameters()), serial_chunks(cfg, data[0][0].shape[0])
    losses = [serial_step(net, optimizer, loss_fn, x, y, chunks) for x, y in data]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_mixed(ctx: Context, kwargs: dict[str, Any], batch: int) -> str:
    """Losses on every rank and every rank's copies of its stages (tiles, replicas, mirrors) against one process
    (rank 0's, scattered to the holders); the serial run moved the weights."""
    from tests.mpi.engine_exact import state_error

    cfg, data = ParallelConfig(**kwargs), mixed_data(batch)
    losses, engine = train_mixed(ctx, cfg, data)
    want_losses, want_state = one_process(cfg, data) if ctx.rank == 0 else (None, None)
    if ctx.rank == 0:
        initial = torch.nn.Sequential(*tiny_vit_layers()).state_dict()
        moved = state_error(want_state, initial, "serial", None)
        assert moved > 1e-3, f"training barely moved the weights ({moved:.1e})"
    want_losses = ctx.bcast_object(want_losses)
    mine = engine.scatter_to_holders(want_state)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses, strict=True))
    assert loss_error <= MIXED_RTOL, f"losses {losses} vs one process {want_losses}"
    worst = 0.0
    for inst in engine.instances.values():
        held = inst.canonical.full_state_dict()
        worst = max(worst, state_error(held, {k: mine[k] for k in held}, f"rank {ctx.rank} stage {inst.stage} "
                                       f"copy {inst.replica}", MIXED_RTOL))
    return f"stages {engine.held_stages()}: loss error {loss_error:.1e}, weights {worst:.1e}"


def check_bf16(ctx: Context) -> str:
    """The CNN path's bf16 rule (tests/support/bf16_rule.py): float32 master weights, bf16 autocast; losses within
    1e-2 of one process under the same autocast, every tensor of the state within twice fp32's distance from it;
    bf16 not bit-equal to fp32 (autocast applied)."""
    from tests.support.bf16_rule import bf16_loss_error, bf16_state_error

    cfg = ParallelConfig(**BF16, precision="bf16")
    data = mixed_data(4, torch.float32)
    losses, engine = train_mixed(ctx, cfg, data, torch.float32)
    state = engine.full_state_dict()
    if ctx.rank != 0:
        return "rank 0 compares"
    want_losses, want_state = one_process_float32(cfg, data, autocast=True)
    fp32_losses, fp32_state = one_process_float32(cfg, data, autocast=False)
    assert losses != fp32_losses, "bf16 gave the float32 losses bit for bit: autocast did not apply"
    loss_error = bf16_loss_error(losses, want_losses)
    worst = bf16_state_error(state, want_state, fp32_state)
    return f"loss rel err {loss_error:.1e}, worst state error / bf16 noise {worst:.2f}"


def mixed_main(check: Checks, ctx: Context) -> None:
    """The mixed checks of this world size."""
    for label, (kwargs, batch) in MIXED.items():
        if ParallelConfig(**kwargs).world_size == ctx.world_size:
            with check(mixed_name(label)) as result:
                result.detail = check_mixed(ctx, kwargs, batch)
    if ParallelConfig(**BF16).world_size == ctx.world_size:
        with check(bf16_name()) as result:
            result.detail = check_bf16(ctx)


def main(check: Checks) -> None:
    import sys

    torch.set_num_threads(1)
    ctx = Context()
    if "mixed" in sys.argv[1:]:
        mixed_main(check, ctx)
        ctx.barrier()
        return
    assert ctx.world_size == 4, "run with 4 ranks"
    for rows, cols in GRIDS:
        grid = TileGrid(rows, cols)
        for index, (label, (name, size, kwargs)) in enumerate(models(rows, cols).items()):
            with check(exact_name(rows, cols, label)) as result:
                result.detail = check_model(ctx, grid, index, name, size, kwargs)
        for label in REFUSALS:
            with check(refusal_name(rows, cols, label)) as result:
                result.detail = check_refusal(ctx, grid, label)
    with check(trace_name()) as result:
        result.detail = trace_check(ctx)
    memory_checks(check, ctx)
    ctx.barrier()


if __name__ == "__main__":
    pin_bf16_kernels()     # before the first convolution (tests/support/bf16_rule.py)
    run_checks(main)
