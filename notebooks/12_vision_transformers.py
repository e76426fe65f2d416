# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 12 — Vision transformers on tiles: a timm ViT over 4 ranks, exact against one process
#
# Pathology's foundation models (UNI, Virchow, Prov-GigaPath, H-optimus, DINOv2 backbones) are timm vision
# transformers, and a larger field of view is where they run out of memory first: the tokens grow with the
# pixels, attention with their square. Here a ViT runs on a 2 x 2 grid of tiles, one per MPI rank: each rank
# holds its tile's tokens (rank 0 also the class token), and attention, which mixes every token with every
# other, runs as *ring attention*: each rank's keys and values travel around the ring of ranks, block by block,
# and every rank merges what it sees with a running log-sum-exp. No rank holds all keys, nor an N x N matrix.
#
# **What you will learn**: how `dl.spatialize` puts an unchanged timm ViT on token tiles; which rank's keys a
# query token meets at which ring step; how to check a training step on 4 ranks against one process yourself;
# how a rank's activation memory compares with one process's as the tokens grow, and why that share is not
# monotone; where the class token looks across the tile seams.
#
# **What you need**: notebooks 02 (tiles) and 04 (exactness against one process); the `models` extra (timm:
# `make install` has it); 4 MPI ranks (started below); a minute or two. The ViT is tiny (2 blocks, width 96) so
# that it runs on a laptop; the code is the same at ViT-S/16 and beyond.

# %%
import matplotlib.pyplot as plt
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz
from mpi4dl_nb.data.sample import ihc_image
from mpi4dl_nb.notebook.attention_view import (
    RingTokens,
    draw_query_attention,
    draw_ring_arrivals,
    vit_attention,
    vit_token_grid,
)

torch.set_num_threads(1)

# %% [markdown]
# ## A pathology tile and a ViT
#
# A 256 x 256 crop of the bundled IHC-stained colon tissue (brown: DAB-stained cells, blue: nuclei), and
# timm's `vit_small_patch16_224` made small with timm's own keywords: 16 x 16 patches make a 16 x 16 grid of
# tokens, plus the class token in front: 257 tokens. Float64, so that "equal" can mean 1e-10.

# %%
SIZE, PATCH = 256, 16
VIT = dict(img_size=SIZE, depth=2, embed_dim=96, num_heads=4, num_classes=2)


def make_vit(size=SIZE):
    import timm
    import torch

    torch.manual_seed(0)
    return timm.create_model("vit_small_patch16_224", **{**VIT, "img_size": size}).double()


picture = ihc_image()[:SIZE, :SIZE]
image = torch.from_numpy(picture / 255.0).permute(2, 0, 1)[None].double()      # (1, 3, 256, 256)
vit = make_vit()
tokens = vit_token_grid(vit, (SIZE, SIZE))
grid = dl.TileGrid(rows=2, cols=2)
tiles = RingTokens(tokens, grid)
print(f"{tokens.rows} x {tokens.cols} grid tokens + {tokens.prefix} class token = {tokens.total} tokens;",
      "tokens per rank:", tokens.member_tokens(grid))
viz.show(viz.draw_tiles_and_halos(picture, grid))

# %% [markdown]
# Each rank's tile is 128 x 128 pixels: 8 x 8 patches, so 64 tokens; rank 0 also holds the class token (65).
# The patch embedding (a 16 x 16 convolution of stride 16) needs no halo: a patch never crosses a seam. A grid
# that would cut a patch is refused before any work, naming the sizes that work.
#
# ## The ring: whose keys, at which step
#
# Every token's attention needs every token's key. Rank `r` first uses its own keys; meanwhile it sends them
# to rank `r + 1` and receives rank `r - 1`'s, and so on: after 3 steps it has met all four blocks, while only
# one block besides its own is ever in its memory. The next block's message is posted before the current
# block's work starts, so the transfer hides behind the compute. For a token on rank 3:

# %%
query = tokens.prefix + 13 * tokens.cols + 11           # token (13, 11): bottom right, rank 3
for arrival in tiles.arrivals(query):
    print(f"step {arrival.step}: rank 3 computes with the {arrival.keys} keys of rank {arrival.owner}")
viz.show(draw_ring_arrivals(tiles, query))

# %% [markdown]
# ## One training step on 4 ranks against one process
#
# Each of the 4 engines builds the same ViT (same seed), `dl.spatialize(vit, grid, ctx)` puts it on its tile
# (position embeddings sliced per tile, the class token on rank 0, ring attention in every block),
# `dl.scatter_tiles` gives each rank its 128 x 128 pixels. The output is the model's output on every rank;
# `dl.reduce_tile_gradients` sums the tile shares of every parameter's gradient.

# %%
cluster = dl.cluster.start(n=4)
cluster.push({"make_vit": make_vit, "VIT": VIT})


def tile_step(x, labels):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.planner import measure_peak_bytes

    torch.set_num_threads(1)
    ctx = dl.init()
    grid = dl.TileGrid(rows=2, cols=2)
    net = dl.spatialize(make_vit(x.shape[-1]), grid, ctx)

    def step():
        out = net(dl.scatter_tiles(x, grid, ctx))
        nn.functional.cross_entropy(out, labels).backward()
        return out.detach()

    out, peak = measure_peak_bytes(step)
    dl.reduce_tile_gradients(net)
    grads = {name: p.grad for name, p in net.named_parameters() if p.grad is not None}
    return out, grads, peak - sum(g.numel() * g.element_size() for g in grads.values())


labels = torch.tensor([1])
ranks = cluster.run(tile_step, image, labels, timeout=300)
reference = make_vit()
logits = reference(image)
torch.nn.functional.cross_entropy(logits, labels).backward()
out = logits.detach()
output_error = max(float((r[0] - out).abs().max() / out.abs().max()) for r in ranks)
grad_error = max(float((grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
                 for _, grads, _ in ranks for name, p in reference.named_parameters() if name in grads)
print(f"logits on rank 0: {ranks[0][0].tolist()}, one process: {out.tolist()}")
print(f"max relative difference: output {output_error:.1e}, gradients {grad_error:.1e} over "
      f"{len(ranks[0][1])} parameters -> exact: {output_error < 1e-10 and grad_error < 1e-10}")

# %% [markdown]
# The differences are float64 rounding: the ranks add the same products in another order (the ring merges the
# four blocks of keys with a running maximum and log-sum-exp, and the gradients are summed over tiles). A
# missing block or a wrong position embedding would show at once as a difference of 1e-2.
#
# ## Activation memory per rank against tokens
#
# Everything in a block but attention acts per token, so a rank's activations are those of its tokens: about
# 1/4 of one process's if both keep the same bytes per token. Attention decides whether they do: ring attention
# adds the key/value blocks in flight and the scores of one ring step. The same step at three image sizes, the
# peak bytes above the weights (gradients left out) on the largest rank (rank 0, with the class token) against
# one process, and each one's bytes per token it holds:

# %%
from mpi4dl_nb.planner import measure_peak_bytes


def serial_peak(size):
    model = make_vit(size)
    x = torch.rand(1, 3, size, size, dtype=torch.float64)

    def step():
        torch.nn.functional.cross_entropy(model(x), labels).backward()

    peak = measure_peak_bytes(step)[1]
    return peak - sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)


sizes, one, largest = [128, 256, 384], [], []
for size in sizes:
    x = torch.rand(1, 3, size, size, dtype=torch.float64)
    one.append(serial_peak(size))
    largest.append(max(peak for _, _, peak in cluster.run(tile_step, x, labels, timeout=300)))
counts = [(s // PATCH) ** 2 + 1 for s in sizes]
for count, a, b in zip(counts, one, largest):
    held = (count - 1) // 4 + 1                               # rank 0's tokens: its quarter and the class token
    print(f"{count:4d} tokens: one process {a / 2**20:5.2f} MB ({a / count / 1024:4.1f} KB per token), largest "
          f"rank of 4 {b / 2**20:5.2f} MB ({b / held / 1024:4.1f} KB per token) = {b / a:.2f} of one process")
figure, axis = plt.subplots(figsize=(5, 3.4))
axis.plot(counts, [a / 2**20 for a in one], "o-", label="one process")
axis.plot(counts, [b / 2**20 for b in largest], "s-", label="largest of 4 ranks")
axis.plot(counts, [a / 4 / 2**20 for a in one], ":", color="grey", label="1/4 of one process")
axis.set_xlabel("tokens")
axis.set_ylabel("peak MB (activations)")
axis.legend(fontsize=8)
plt.show()

# %% [markdown]
# The share is not monotone: 0.45 of one process at 65 tokens, 0.18 at 257, then 0.33 at 577, above the 1/4
# line. It is about a rank's bytes per token over 4 times one process's, and the KB per token say why:
#
# * A rank keeps about 13 KB per token at 17 and 65 tokens, then 30 KB at 145. It computes each ring step with
#   plain matmuls (on a CPU, and in float64, no fused kernel gives the log-sum-exp the merge needs:
#   `spatial/tokens/blocks.py`), making the scores of its queries against one block of keys, (N/4) x (N/4) per
#   head, in the forward and again in the backward: they grow with the square of the tokens it holds.
# * One process here is timm's attention, which calls torch's `scaled_dot_product_attention`; on a CPU that runs
#   its flash kernel, float64 included, which never makes the N x N matrix. Its bytes per token grow too (7, 19,
#   then 24 KB), but less than a rank's past 257 tokens.
#
# So at 65 tokens a rank keeps more per token than one process (0.45), at 257 less (0.18), and past that its
# score blocks grow faster than one process's flash kernel: the share climbs back. Run the one-process step
# inside `torch.nn.attention.sdpa_kernel([SDPBackend.MATH])`, timm's attention as plain matmuls keeping each
# head's N x N weights, and one process takes 10.8 MB at 257 tokens and 48.8 MB at 577: a rank's share of that
# is under 0.1. A fair comparison runs the same attention kernel on both sides: against one process with the
# same blockwise attention, ViT-S/16 at 1024 x 1024 (4,097 tokens) keeps 0.500 per rank on P = 2 and 0.250 on
# P = 4 (`benchmarks/bench_vit.py`, BENCHMARKS.md section 14).
#
# ## The class token's attention across the tile seams
#
# The class token lives on rank 0, yet it attends to every token of the image: its query meets the other ranks'
# keys in the ring. Its attention in the last block, averaged over heads (computed here in one process, which
# the ranks equal), drawn over the tile with the seams and each rank's share of the attention; the colour bar
# gives each token's weight (the 257 weights sum to 1, so an even spread is about 0.004). Pick another query in
# the viewer: a token's steps and map follow.

# %%
from mpi4dl_nb.notebook.widgets import AttentionViewer

reference.eval()
figure = draw_query_attention(picture, tiles, vit_attention(reference, image, 0), 0)
heat = next(layer for layer in figure.axes[0].images if layer.get_gid() == "attention")
figure.colorbar(heat, ax=figure.axes[0], fraction=0.046, pad=0.03, label="attention weight of a token")
viz.show(figure)
viewer = AttentionViewer(picture, tiles, lambda q: vit_attention(reference, image, q))
viewer.widget

# %% [markdown]
# An untrained ViT spreads its attention almost evenly: each rank's share is close to its share of the tokens.
# A trained one (`--weights` with a foundation model's file) looks at structures, wherever they lie: the ring
# makes a seam invisible to attention.
#
# ## What fits where: foundation models per rank budget, by ZeRO stage
#
# The same accounting at the size of pathology's foundation models: a ViT-H/14 of Virchow2's depth and width (timm's
# plain MLP; `--model virchow2` builds its SwiGLU one) and Prov-GigaPath's ViT-g/14 (1.1 billion parameters), at
# 1024² px. The planner (`dl.planner.estimate_memory`) counts a training step's peak on every rank, weights,
# gradients, AdamW's two states, gradient buckets and activations with the ring's blocks in flight, shape-only on
# the `meta` device: nothing is allocated, so a ViT-g plans on a laptop. Tiles split the activations, not the state:
# every tile rank holds the whole model. `--zero-stage` (`zero_stage`) shards the state over the ranks that hold the
# same weights, here the tiles: 1 the optimizer's, 2 also the gradients, 3 also the weights (gathered for each use).
# Below, the largest rank's peak on P = 1, 2 (1 x 2) and 4 (2 x 2) tiles at ZeRO 0-3, without and with activation
# recomputation, and the first setting that fits 16, 40 and 80 GB (float32, batch 1). The planner runs no MPI: the
# four engines just share the plans (about a minute).

# %%
FOUNDATION = {"ViT-H/14 (Virchow2 size)": "vit_huge_patch14_224",
              "ViT-g/14 (Prov-GigaPath)": "vit_giant_patch14_dinov2"}
BUDGETS_GB = (16, 40, 80)
SIDE = 1024


def zero_peaks(tasks, side):
    import timm
    import torch

    import mpi4dl_nb as dl

    found = {}
    for name, parts, zero, recompute in tasks[dl.init().rank::4]:
        with torch.device("meta"):                          # shapes only: no weights allocated
            model = timm.create_model(name, img_size=side, num_classes=2, weight_init="skip")
        cfg = dl.ParallelConfig(split_size=1, spatial_size=int(parts > 1), num_spatial_parts=parts,
                                slice_method="square" if parts == 4 else "vertical", zero_stage=zero,
                                checkpoint_activations="every" if recompute else None)
        layers = dl.layer_list(model, check=False)
        plan = dl.planner.estimate_memory(layers, cfg, side, 1, optimizer_states=2)    # AdamW: 2 states
        found[(name, parts, zero, recompute)] = plan.peak / 1e9
    return found


def stages(parts):
    return range(4) if parts > 1 else (0,)                 # one rank: nothing to shard


tasks = [(name, parts, zero, recompute) for name in FOUNDATION.values() for parts in (1, 2, 4)
         for zero in stages(parts) for recompute in (False, True)]
peaks = {}
for part in cluster.run(zero_peaks, tasks, SIDE, timeout=900):
    peaks.update(part)
for label, name in FOUNDATION.items():
    for parts in (1, 2, 4):
        settings = [(zero, recompute) for recompute in (False, True) for zero in stages(parts)]
        shown = " | ".join(("recompute " if r else "") + f"ZeRO {z} {peaks[name, parts, z, r]:.1f}"
                           for z, r in settings)
        fits = []
        for gb in BUDGETS_GB:
            first = next(((z, r) for z, r in settings if peaks[name, parts, z, r] <= gb), None)
            fits.append(f"{gb} GB: " + ("none" if first is None else f"ZeRO {first[0]}" + " + recompute" * first[1]))
        print(f"{label} P = {parts}: peak GB {shown}\n    first that fits: " + ", ".join(fits))

# %% [markdown]
# ViT-g/14 fits no 16 GB rank without sharding: its 1.1 billion float32 weights, their gradients and AdamW's two
# states take about 18 GB before a single activation. On 4 tiles ZeRO 3 keeps a quarter of that per rank, and the
# rank peaks at 13.7 GB, with or without recomputation: it fits. ZeRO 3 gathers the weights layer by layer (each
# block before its forward and its backward, freed after: two blocks, 0.2 GB, at once), but the peak still falls less
# than the state: backward builds the whole gradients and the reduce-scatter copies them flat (4.6 GB each), and
# ZeRO 1 and 2 keep the whole weights, their shards slices of them (`layout --model` prints the state per level).
# Recomputation (`checkpoint_activations="every"`: each block keeps only its input) shrinks the activations, which
# at ZeRO 3 here are no longer what peaks. BENCHMARKS.md
# section 18 has the same table at 1024² and 2048² on up to 8 ranks (`benchmarks/bench_zero_memory.py`), the
# planner's state bytes beside those of real sharded runs, and its bytes per block and per step beside measured ones.
#
# ## Exercise: what a rank sends
#
# **Predict**: in one block's forward, how many bytes does rank 0 send around the ring? (Keys and values of
# width 96 in float64, one image; rank 0 passes on every block but its successor's own.) And in the backward?
# Write your guess, then run the cell.

# %%
from mpi4dl_nb.planner.attention import ring_cost

my_guess = {"forward": None, "backward": None}
cost = ring_cost(tokens.member_tokens(grid), 0, 96, 4, 8)
print(f"rank 0 sends {cost.sent_forward} bytes forward, {cost.sent_backward} backward, in {cost.messages_forward} "
      f"and {cost.messages_backward} messages")

# %% [markdown]
# Forward: the blocks it holds at steps 0, 1 and 2 (its own 65 tokens, then rank 3's 64 and rank 2's 64),
# keys and values: 2 x 193 x 96 x 8 = 296,448 bytes, about 2 (N/P) C (P - 1). Backward: the same blocks again,
# plus the key/value gradient of every block but its own: each rank keeps its own block's share, and another's
# accumulator starts at the next rank and reaches its owner in 3 hops: 296,448 + 2 x 192 x 96 x 8 = 591,360 bytes.
# All-gathering the keys instead sends as much forward, but every rank then holds all 257 keys and values at once.
#
# ## What to try next
#
# * `dl.TileGrid(rows=1, cols=4)` (strips): the same tokens per rank, other seams; or a ViT with register
#   tokens (`reg_tokens=4`): all held by rank 0.
# * `--model timm:vit_small_patch16_224 --image-size 448 --split-size 2 --spatial-size 1 --num-spatial-parts 4`
#   trains the same way from the command line (docs/spatial.md, "Attention across ranks").
# * The planner counts attention blocks too: `dl.planner.estimate_memory` of a ViT's layer list on
#   `num_spatial_parts=4` (notebook 05).

# %%
cluster.stop()
