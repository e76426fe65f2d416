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

Usage: python -m tests.mpi.vit_exact   (4 ranks: the 2x2 and the 1x4 grid in one launch)
Named checks: ``check_names()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.planner.attention import TokenGrid, ring_cost
from mpi4dl_nb.spatial.blockwise import blockwise_attention
from mpi4dl_nb.spatial.convert import spatialize
from mpi4dl_nb.spatial.geometry import TileGrid
from mpi4dl_nb.spatial.tiles import scatter_tiles
from tests.support.allocations import ActivationProfile, profile_activations
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
        assert len(hops) == size, f"{layer}: {len(hops)} gradient hops, want {size}"
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

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(tile), label).backward()
        reduce_tile_gradients(net)
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

def main(check: Checks) -> None:
    torch.set_num_threads(1)
    ctx = Context()
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
    run_checks(main)
