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

# %%
halo = grid.layer_halo(512, 512, kernel=3, stride=1, padding=1, name="conv 3x3")
print(halo.describe())
viz.show(viz.draw_tiles_and_halos(image, grid, halo))

# %% [markdown]
# Wider windows need wider halos; strides shrink the map (the halo of layer *k* lives on its own feature map,
# scaled onto the image here). Tile 0's bands, corner included:

# %%
wide = grid.layer_halo(128, 128, kernel=7, stride=2, padding=3, name="conv 7x7 / 2 on a 128x128 map")
print(viz.halo_bands(wide.tile(0), 128, 128))
viz.show(viz.draw_tiles_and_halos(image, grid, wide, tiles=[0]))

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
# ## The exchange for real, on 4 MPI ranks
#
# `dl.spatialize` turns the conv into one that exchanges halos (forward) and sends halo
# gradients back (backward, the exact adjoint). Output and weight gradient equal the
# single-process conv in float64.

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
            float((grad - ref_grad).abs().max()))

for rank, (shape, out_err, grad_err) in enumerate(cluster.run(tiled_conv, image[:128, :128], timeout=120)):
    print(f"rank {rank}: tile {shape}, max |output - serial| = {out_err:.1e}, max |dW - serial| = {grad_err:.1e}")

# %%
cluster.stop()
