# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 02 — Slicing and halos on a pathology tile
#
# **What you will learn**: how spatial parallelism cuts an image into tiles, what a *halo* is and how wide
# it is for each layer, why spatial parallelism pays off in the early, high-resolution layers and not in
# the late ones, and that a convolution computed on 4 ranks gives the single-process result.
#
# **What you need**: notebook 01 (the schemes); 4 MPI ranks (started below); about a minute.
#
# Spatial parallelism gives every rank one tile of the image. A 3x3 convolution near a
# tile border needs pixels of the neighbour: the *halo*. The geometry is pure index math
# (`dl.TileGrid`): each rank owns a range of the output, the input range it needs minus
# the range it has is the halo per side. Exchanges go rows first, then columns over the
# full needed row range, so corners arrive without diagonal messages.

# %%
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz

torch.set_num_threads(1)

# %%
from mpi4dl_nb.data.sample import ihc_image

image = ihc_image()            # a real IHC-stained colon tissue tile, 512x512 RGB
grid = dl.TileGrid.from_slice_method("square", 4)
print(grid, [grid.tile_box(t, 512, 512) for t in range(grid.num_tiles)])
viz.show(viz.draw_tiles_and_halos(image, grid))

# %% [markdown]
# The 512 x 512 tissue image (brown: DAB-stained cells, blue: nuclei) cut into a 2 x 2 grid; each rank
# holds one 256 x 256 tile, a quarter of the pixels and so a quarter of every early layer's activations.

# %%
halo = grid.layer_halo(512, 512, kernel=3, stride=1, padding=1, name="conv 3x3")
print(halo.describe())
viz.show(viz.draw_tiles_and_halos(image, grid, halo))

# %% [markdown]
# A 3x3 convolution with padding 1 needs one row/column beyond the tile on every inner side: the coloured
# bands. Outer sides need nothing (the image's own zero padding applies there, as in one process). Each
# tile receives 2 messages here (one per neighbour; the corner pixel rides along with the column message).

# %% [markdown]
# Wider windows need wider halos; strides shrink the map (the halo of layer *k* lives on its own feature map,
# scaled onto the image here). Tile 0's bands, corner included:

# %%
wide = grid.layer_halo(128, 128, kernel=7, stride=2, padding=3, name="conv 7x7 / 2 on a 128x128 map")
print(viz.halo_bands(wide.tile(0), 128, 128))
viz.show(viz.draw_tiles_and_halos(image, grid, wide, tiles=[0]))

# %% [markdown]
# A 7x7 stride-2 window reaches 3 pixels out, but the stride means a tile's outputs start at an even pixel:
# tile 0 needs a few rows and columns from its neighbours below and right (its bands), the corner included.
# Wider windows and smaller maps make the halo a bigger share of the tile; the exercise below measures it.

# %% [markdown]
# The halo viewer walks the convs/pools of a real model (ResNet here) at its feature-map sizes:

# %%
from mpi4dl_nb.models import build_model
from mpi4dl_nb.notebook.widgets import HaloViewer

model = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
viewer = HaloViewer(image, model, image_size=512)
viewer.widget

# %%
viewer.tile_choice.value = 3
viewer.slice_choice.value = "vertical"
print(viewer.describe())

# %% [markdown]
# In a vertical grid (4 strips side by side) tile 3 is the rightmost strip: it has a neighbour only on its
# left, so it receives one column message as tall as the image, and zero padding applies on its other sides
# as in one process. Strips need fewer messages than a 2 x 2 grid but longer ones, and their halo share grows
# faster as the strips get thinner.
#
# ## Exercise: halo bytes against tile bytes, layer by layer, as tiles shrink
#
# **Predict**: for the first convolution of a ResNet-29 at 512 px, what share of a tile is halo with 4 tiles
# (2x2)? With 64 tiles (8x8)? And for the last block's convolution, on its 128 x 128 map? The cell measures,
# for every windowed layer, the pixels a middle tile receives as halo divided by the pixels it owns (bytes
# scale the same way: same channels, same dtype). Change `GRIDS` to try others.

# %%
from mpi4dl_nb.notebook.widgets.halo_viewer import windowed_layers

GRIDS = (dl.TileGrid(2, 2), dl.TileGrid(4, 4), dl.TileGrid(8, 8))


def halo_share(layer, grid):
    """Halo pixels received / owned pixels, for the tile with the most neighbours."""
    halo = layer.halo(grid)
    def received(tile):
        return sum((m.box[1] - m.box[0]) * (m.box[3] - m.box[2]) for m in halo.messages(tile) if m.dst == tile)
    tile = max(range(grid.num_tiles), key=received)
    r0, r1, c0, c1 = halo.tile(tile).owned_box
    return received(tile) / ((r1 - r0) * (c1 - c0))


deep = build_model("resnet", num_layers=29, num_filters=8, num_classes=2)
layers = [layer for layer in windowed_layers(deep, 512) if layer.kernel != (1, 1)]   # skip 1x1 shortcuts
print(f"{'layer':18} {'map':>9} " + " ".join(f"{f'{g.rows}x{g.cols} tiles':>11}" for g in GRIDS))
shares = {}
for layer in layers:
    shares[layer.name] = [halo_share(layer, g) for g in GRIDS]
    print(f"{layer.name:18} {f'{layer.height}x{layer.width}':>9} " + " ".join(f"{v:11.1%}" for v in shares[layer.name]))
first, last = shares[layers[0].name], shares[layers[-1].name]
assert all(a < b for a, b in zip(first, first[1:])), "smaller tiles: a larger share of halo"
assert all(b > a for a, b in zip(first, last)), "the late, small maps pay more halo per owned pixel"

# %% [markdown]
# Read it column by column: with 4 tiles the halo is under 1% of a tile in the full-resolution layers; it
# grows as tiles shrink (6% with 64 tiles) and as the maps shrink with depth (27% on the 128 x 128 map with
# 64 tiles: a 16-pixel tile pays a pixel on every side). The stride-2 layers pay less (their outputs start
# on even pixels). Early layers are where the activations are largest and the halo cheapest: spatial
# parallelism there. Late layers have small maps, small activations and expensive halos: give them
# to layer parallelism (the argument of MPI4DL's Figure 1, and why `spatial_size` counts the *first* stages).

# %% [markdown]
# ## The exchange for real, on 4 MPI ranks
#
# `dl.spatialize` turns the conv into one that exchanges halos (forward) and sends halo
# gradients back (backward, the exact adjoint). Output and weight gradient equal the
# single-process conv in float64 up to float rounding: the weight gradient is the sum of the 4 tiles'
# shares, added in a different order than one process adds them, so it differs in the last digits
# (float64 rounding, ~1e-15 relative to the gradient's size), never more.

# %%
cluster = dl.cluster.start(n=4)


# %%
def tiled_conv(pixels):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    ctx = dl.init()
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.tensor(pixels).permute(2, 0, 1)[None].double() / 255
    reference = conv(x)
    reference.square().sum().backward()
    ref_grad = conv.weight.grad.clone()
    conv.zero_grad()
    grid = dl.TileGrid(2, 2)
    net = dl.spatialize(conv, grid, ctx)
    tile = dl.scatter_tiles(x, grid, ctx)
    out_tile = net(tile)
    out_tile.square().sum().backward()
    full = dl.gather_tiles(out_tile.detach(), grid, ctx)
    grad = conv.weight.grad.clone()
    ctx.all_reduce(grad)                    # tile shares of the weight gradient add up
    return (tuple(tile.shape), float((full - reference).abs().max()),
            float((grad - ref_grad).abs().max() / ref_grad.abs().max()))

for rank, (shape, out_err, grad_err) in enumerate(cluster.run(tiled_conv, image[:128, :128], timeout=120)):
    print(f"rank {rank}: tile {shape}, max |output - serial| = {out_err:.1e}, "
          f"max |dW - serial| / max |dW| = {grad_err:.1e}")
    assert out_err < 1e-10 and grad_err < 1e-12, "not equal up to float rounding"


# %% [markdown]
# ## Fused halos (`halo_d2`): fewer, wider exchanges
#
# Each windowed layer exchanges its own halo. With `halo_d2=True` and `fused_layers=k`, the first layer of a
# run of `k` gets one halo wide enough for all `k` (the sum of their halos), and the next `k-1` layers
# compute the overlap redundantly instead of exchanging again: fewer messages (latency), more compute.
# **Predict** how many halo exchanges a forward of 3 stacked 3x3 convs makes per rank, with and without it;
# the cell counts them in each rank's trace and checks the outputs still agree.

# %%
def count_exchanges(pixels, fused):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    ctx = dl.init()
    torch.manual_seed(0)
    stack = nn.Sequential(*[nn.Conv2d(3, 3, 3, padding=1) for _ in range(3)]).double()
    x = torch.tensor(pixels).permute(2, 0, 1)[None].double() / 255
    reference = stack(x)
    net = dl.spatialize(stack, dl.TileGrid(2, 2), ctx, halo_d2=fused, fused_layers=3 if fused else 1)
    ctx.tracer.clear()
    out = dl.gather_tiles(net(dl.scatter_tiles(x, dl.TileGrid(2, 2), ctx)), dl.TileGrid(2, 2), ctx)
    exchanges = sum(1 for e in ctx.tracer.events if e.op == "halo")
    ctx.tracer.clear()
    return exchanges, float((out - reference).abs().max())

for fused in (False, True):
    counts = cluster.run(count_exchanges, image[:128, :128], fused, timeout=120)
    print(f"halo_d2={fused!s:5}: halo exchanges per forward on each rank {[c for c, _ in counts]}, "
          f"max |output - serial| = {max(e for _, e in counts):.1e}")
    assert max(e for _, e in counts) < 1e-10

# %% [markdown]
# One exchange instead of three per forward, same output. On a fast network (or on this 2-core machine,
# BENCHMARKS.md §2a: 8 messages -> 2, 1.03x the time) the difference is small; it matters when message
# latency dominates, e.g. many thin layers over a slow interconnect.
#
# ## What to try next
#
# * In the halo viewer, pick the stride-2 layers and a `vertical` grid: which sides have halos, which trims?
# * Re-run the exercise at `windowed_layers(model, 2048)`: predict how the first column changes.
# * Notebook 03 shows how the stages after the spatial one are scheduled; 04 trains the whole model.

# %%
cluster.stop()
