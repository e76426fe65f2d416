# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 08 — Your own model: a torchvision ResNet-50 and a timm SE-ResNet, exact on tiles
#
# **What you will learn**: how to turn a model you already use (torchvision, timm, or your own `nn.Module`)
# into the engine's layer list with `dl.layer_list`; how to load its pretrained weights by the model's own
# keys (the classifier replaced for your classes); how the op guard reports, layer by layer, whether the
# model is exact on image tiles; where the default stage cut puts each layer; and how to check an SP+LP
# training step against one process yourself.
#
# **What you need**: notebook 04 (SP+LP and what "exact" means); the `models` extra (torchvision and timm:
# `make install` has it); 5 MPI ranks (started below on this machine); 1-3 minutes. Nothing is downloaded:
# the "pretrained" weights are a state dict this notebook saves first, standing in for ImageNet weights.

# %%
import tempfile
from pathlib import Path

import torch
import torchvision
from torch import nn

import mpi4dl_nb as dl

torch.set_num_threads(1)
IMAGE, BATCH, STEPS, CLASSES = 128, 2, 2, 2
folder = Path(tempfile.mkdtemp(prefix="mpi4dl-08-"))
WEIGHTS = folder / "resnet50_1000_classes.pth"
torch.manual_seed(0)
torch.save(torchvision.models.resnet50().state_dict(), WEIGHTS)      # as published: 1000 ImageNet classes
print(f"saved {WEIGHTS.name}: {WEIGHTS.stat().st_size / 2**20:.0f} MB")


# %% [markdown]
# ## The layer list
#
# `dl.layer_list(model)` reads the model's `forward` (with `torch.fx`) and cuts it into pieces the engine
# can place on stages: the stem, every block, and the pooled head (average pool, the `torch.flatten` the
# classifier needs, `fc`). Forward of the pieces equals the model's (checked before it returns), and every
# piece keeps the model's modules at their own paths, so a weights file of the original model loads by its
# keys. `--num-classes 2` differs from the file's 1000 classes: the classifier is replaced and one line
# says so.

# %%
def make_model(name, weights=None):
    """``torchvision:NAME`` or ``timm:NAME`` with CLASSES outputs as a float64 layer list (the same on every rank)."""
    import torch

    import mpi4dl_nb as dl
    library, _, model_name = name.partition(":")
    torch.manual_seed(0)
    if library == "torchvision":
        import torchvision
        model = torchvision.models.get_model(model_name, num_classes=CLASSES)
    else:
        import timm
        model = timm.create_model(model_name, num_classes=CLASSES)
    layers = dl.layer_list(model)
    if weights is not None:
        note = dl.load_weights(layers, dl.read_weights(weights), model=name)
        print(note or "weights loaded")
    return [layer.double() for layer in layers]

layers = make_model("torchvision:resnet50", WEIGHTS)
print(len(layers), "layers:", [layer.paths[0] for layer in layers])
print("keys: engine", next(iter(nn.Sequential(*layers).state_dict())), "-> model",
      next(iter(dl.models.original_state_dict(layers, nn.Sequential(*layers).state_dict()))))

# %% [markdown]
# ## The stage cut, in the configuration panel
#
# SP+LP on 5 ranks: a spatial stage of 2 x 2 tiles, then a layer rank. The default cut keeps every layer
# whose halo fits a tile on the spatial stage and the pooled head on the layer rank; the panel shows the
# layout and the planner's memory per rank for this very layer list (profiled on the meta device).
#
# **Predict** before running: of the 18 layers, how many land on the spatial stage at 128 px? (Each tile
# is 64 x 64; layer4 works on a 4 x 4 feature map, 2 x 2 per tile.)

# %%
from mpi4dl_nb import viz
from mpi4dl_nb.cli.stage_table import stage_table
from mpi4dl_nb.notebook.widgets import ConfigPanel

cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")
print(stage_table(layers, cfg, IMAGE))
viz.show(viz.draw_rank_layout(cfg))
panel = ConfigPanel(cfg, model=layers, image_size=IMAGE, batch_size=BATCH, devices=5)
panel.widget

# %% [markdown]
# ## The op guard's report, layer by layer
#
# The answer: 14 of the 18 layers, the stem to layer3, run on the tiles; layer4 and the pooled head run on the
# layer rank, which receives layer3's 8 x 8 feature map joined from the four tiles.
#
# On the 4 tile ranks, each layer is spatialized alone and run on its tiles; its output, gathered, is
# compared with the same layer on the whole image in one process. Every operation a custom `forward`
# applies (a residual `+`, `torch.flatten`, an SE gate's `x.mean((2, 3))`) passes the op guard, which either
# computes it exactly on tiles or refuses it, naming the module and the op, before any work.

# %%
cluster = dl.cluster.start(n=cfg.world_size)
cluster.push({"CLASSES": CLASSES, "BATCH": BATCH, "IMAGE": IMAGE, "make_model": make_model})


def guard_report(name):
    """Rank 0: (layer, verdict) for every layer before the pooled head, each spatialized alone on 2 x 2 tiles."""
    import copy

    import torch
    from torch import nn

    import mpi4dl_nb as dl
    torch.set_num_threads(1)
    ctx = dl.init()
    grid, tiles = dl.TileGrid(rows=2, cols=2), ctx.new_group([0, 1, 2, 3])
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rows = []
    for layer in make_model(name)[:-1]:
        expected = copy.deepcopy(layer)(x)
        if ctx.rank in tiles:
            try:
                net = dl.spatialize(nn.Sequential(layer), grid, ctx, tiles)
                y = dl.gather_tiles(net(dl.scatter_tiles(x, grid, ctx, tiles)), grid, ctx, tiles)
                verdict = f"exact (max |tiles - one process| = {float((y - expected).abs().max()):.1e})"
            except dl.ConfigError as err:
                verdict = f"refused: {err}"
            rows.append((layer.paths[0], tuple(expected.shape[-2:]), verdict))
        x = expected.detach()
    return rows


def show_report(name):
    for path, size, verdict in cluster.run(guard_report, name, timeout=300)[0]:
        print(f"{path:>12}  out {size[0]:>3}x{size[1]:<3}  {verdict}")

show_report("torchvision:resnet50")


# %% [markdown]
# ## One SP+LP training step, exact against one process
#
# The engine on 5 ranks trains the layer list with the weights from the file; `dl.serial_reference` trains
# the same list in this process. Loss and every weight (BatchNorm statistics included) must agree to
# float64 rounding.

# %%
def optimizer(params):
    import torch
    return torch.optim.SGD(params, lr=0.001, momentum=0.9)

cluster.push({"optimizer": optimizer, "WEIGHTS": str(WEIGHTS)})
generator = torch.Generator().manual_seed(2)
batches = [(torch.rand(BATCH, 3, IMAGE, IMAGE, generator=generator, dtype=torch.float64),
            torch.randint(0, CLASSES, (BATCH,), generator=generator)) for _ in range(STEPS)]


def train(name, knobs, batches, weights=None):
    """Rank 0: the losses of ``batches`` and the trained state dict of the engine (``name``'s layer list)."""
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    torch.set_num_threads(1)
    ctx = dl.init()
    engine = dl.HybridEngine(make_model(name, weights), dl.ParallelConfig(**knobs), ctx,
                             loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer, image_size=IMAGE)
    losses = [engine.train_step(images, labels) for images, labels in batches]
    return losses, engine.full_state_dict()


def check_exact(name, weights=None):
    losses, state = cluster.run(train, name, cfg.as_dict(), batches, weights, timeout=600)[0]
    serial = dl.serial_reference(cfg, make_model(name, weights), batches, loss_fn=nn.CrossEntropyLoss(),
                                 optimizer=optimizer)
    loss_error = max(abs(a - b) for a, b in zip(losses, serial.losses))
    weight_error = max(float((state[k] - v).abs().max()) for k, v in serial.state_dict().items())
    print(f"{name}: losses {[round(loss, 6) for loss in losses]}; max |loss difference| = {loss_error:.1e}, "
          f"max |weight difference| = {weight_error:.1e} over {len(state)} tensors "
          f"-> exact: {loss_error < 1e-9 and weight_error < 1e-9}")
    return loss_error < 1e-9 and weight_error < 1e-9

assert check_exact("torchvision:resnet50", str(WEIGHTS))

# %% [markdown]
# The trained weights go back to torchvision with the model's own keys: a checkpoint's
# `dl.model_state_dict(path)` (the command line's `train --model torchvision:resnet50 --weights W.pth`
# writes one) loads into `torchvision.models.resnet50(num_classes=2)` with `strict=True`. Here, from the
# layer list directly:

# %%
trained = torchvision.models.resnet50(num_classes=CLASSES).double()
print(trained.load_state_dict(dl.models.original_state_dict(layers, nn.Sequential(*layers).state_dict()),
                              strict=True))

# %% [markdown]
# ## A timm model with squeeze-excitation
#
# timm's SE-ResNet-18 gates every block's channels with `x.mean((2, 3), keepdim=True)` (a global mean over
# the image, written as a tensor method) followed by two 1 x 1 convolutions and a sigmoid. On tiles, the op
# guard computes that mean over the whole image (each tile's sum, all-reduced) and keeps the gate's
# gradient exact; the same report and step check apply unchanged.

# %%
show_report("timm:seresnet18")
assert check_exact("timm:seresnet18")

# %%
import shutil

cluster.stop()
shutil.rmtree(folder)        # the weights file this notebook saved

# %% [markdown]
# ## What to try next
#
# * Another model: `show_report("timm:efficientnet_b0")`, `"torchvision:convnext_tiny"` or
#   `"torchvision:densenet121"` (start the cluster again first). A model with an operation that cannot be
#   exact on tiles is refused with the module and the op: the report says which layer.
# * In the panel, set `image_size` to 64: which layers leave the spatial stage, and why?
# * The same on the command line: `python -m mpi4dl_nb layout --model torchvision:resnet50 --image-size 128
#   --split-size 2 --spatial-size 1 --num-spatial-parts 4`, then `train --model torchvision:resnet50
#   --weights W.pth` and `evaluate`/`infer` on its checkpoint (`docs/your-own-model.md`, with a complete
#   script from a tile folder to a slide map).
