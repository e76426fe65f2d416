# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 04 — Hybrid SP + LP training on pathology tiles, checked against one process
#
# **What you will learn**: how to train a real model with a spatial stage (the image cut into 4 tiles) and a
# layer stage on a fifth rank; what "exact" means and how to check it yourself; how much memory the split
# saves per rank and what it costs in speed, next to the same training on one process.
#
# **What you need**: notebooks 01 (rank layout) and 02 (halos); 5 MPI ranks (started below on this machine);
# about 2 minutes.
#
# The model is a ResNet (v2, pre-activation blocks). The task: crops of a real IHC-stained tissue image,
# labelled **high vs low DAB stain** (the brown immunostain): the label is the crop's DAB-density quantile
# class (2 classes: below or above the median crop). We train a few steps in float64 and compare loss and
# every weight with the same model trained in this notebook on one process; then we train it longer and watch
# its accuracy on crops it never saw rise above chance.

# %%
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz

torch.set_num_threads(1)

# %% [markdown]
# The configuration. `balance=(4, 1)` puts the stem and all three residual blocks on the spatial stage (each
# tile rank holds a quarter of their activations) and only the classifier head on the layer rank. With the
# split by layer count (`balance=(2, 3)`: stem and block 1, then blocks 2-3 and the head) the layer rank
# would receive the full-resolution output of block 1 and hold nearly everything one process holds: the
# split would save little. The exercise below measures both.

# %%
import json

import numpy as np
from torch import nn

from mpi4dl_nb.data.sample import IHCSampleDataset

IMAGE, BATCH, STEPS, DEPTH, WIDTH = 128, 2, 3, 11, 8
BALANCE = (4, 1)
cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square", balance=BALANCE)
data = IHCSampleDataset(IMAGE, num_classes=2)
picks = [[(7 * (step * BATCH + i)) % len(data) for i in range(BATCH)] for step in range(STEPS)]
batches = [(torch.stack([data.read(i) for i in idx]).double(), torch.tensor([data.label(i) for i in idx]))
           for idx in picks]
print(cfg.world_size, "ranks:", cfg.describe_world(), "| dataset:", len(data), "crops,",
      "labels of this batch (0 = low DAB, 1 = high DAB):", batches[0][1].tolist())
viz.show(viz.draw_rank_layout(cfg))

# %% [markdown]
# Ranks 0-3 each hold one tile of stage 0 (the 2 x 2 grid); rank 4 holds stage 1 and receives the four
# tiles' outputs at the *hand-off* (the tiles are joined into the full feature map there). The halo of the
# first 3x3 convolution on the first image of the batch:

# %%
grid = dl.TileGrid.from_slice_method(cfg.slice_method, cfg.num_spatial_parts)
first = grid.layer_halo(IMAGE, IMAGE, kernel=3, padding=1, name="stem conv 3x3")
viz.show(viz.draw_tiles_and_halos(batches[0][0][0], grid, first))


# %% [markdown]
# Each tile owns a 64 x 64 quarter and needs one extra row/column from each neighbour (the coloured bands),
# corners included. One pixel of halo on a 64-pixel tile is ~3% extra traffic per conv: cheap at this
# resolution, and cheaper still on real 2048+ px tiles.

# %%
def make_model():
    import torch

    from mpi4dl_nb.models import build_model
    torch.manual_seed(0)
    return [layer.double() for layer in build_model("resnet", num_layers=DEPTH, num_filters=WIDTH, num_classes=2)]

def optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)

cluster = dl.cluster.start(n=cfg.world_size)
cluster.execute("import torch")
cluster.push({"DEPTH": DEPTH, "WIDTH": WIDTH, "make_model": make_model, "optimizer": optimizer})

def setup(knobs):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    global eng
    torch.set_num_threads(1)
    ctx = dl.init()
    eng = dl.HybridEngine(make_model(), dl.ParallelConfig(**knobs), ctx,
                          loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
    return ctx.rank

cluster.run(setup, cfg.as_dict(), timeout=120)

# %% [markdown]
# Train on the cluster with a progress bar (each step is one remote call with a timeout):

# %%
from IPython.display import display

from mpi4dl_nb.notebook.widgets import TrainingProgress


def train_step(images, labels):
    return eng.train_step(images, labels)

progress = TrainingProgress(STEPS)
display(progress.widget)
parallel_losses = progress.run(lambda i: cluster.run(train_step, *batches[i - 1], timeout=300)[0],
                               images_per_step=BATCH)
images_per_second = float(np.mean(progress.images_per_second))
print("losses:", parallel_losses, f"| {images_per_second:.2f} images/s on {cfg.world_size} ranks")


# %% [markdown]
# ## Exact: the same numbers as one process
#
# "Exact" means: equal, to float64 rounding, to the **serial reference** — `nn.Sequential(*layers)` on one
# process, the global batch cut into the engine's micro-batches (*chunks*) and run one after another with
# gradient accumulation, then one optimizer step (docs/engine.md). With `parts=1` and no GEMS that is plain
# full-batch training; with `parts=2` BatchNorm sees half-batches, in the engine and in the reference alike.
# `dl.serial_reference(cfg, layers, batches, ...)` builds it for any configuration:

# %%
def compare(cfg, parallel_losses, parallel_state, batches):
    """Max |loss difference| and max |weight difference| between a parallel run and its serial reference."""
    reference = dl.serial_reference(cfg, make_model(), batches, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
    state = reference.state_dict()
    loss_error = max(abs(a - b) for a, b in zip(parallel_losses, reference.losses))
    weight_error = max(float((parallel_state[k].double() - v.double()).abs().max()) for k, v in state.items())
    return reference, loss_error, weight_error

def full_state():
    return eng.full_state_dict()

parallel_state = cluster.run(full_state, timeout=120)[0]
serial, loss_error, weight_error = compare(cfg, parallel_losses, parallel_state, batches)
exact = loss_error < 1e-10 and weight_error < 1e-10
serial_images_per_second = serial.images_per_second(BATCH)
print(f"max |loss difference| = {loss_error:.2e}, max |weight difference| = {weight_error:.2e} "
      f"over {len(parallel_state)} tensors (weights, BatchNorm statistics) -> exact: {exact}")
print(f"speed: {images_per_second:.2f} images/s on {cfg.world_size} ranks, "
      f"{serial_images_per_second:.2f} images/s on one process")
assert exact

# %% [markdown]
# Why no speed-up here (on this 2-core machine, when quiet: 6.9 images/s on 5 ranks, 13-16 on one
# process)? 5 ranks share 2 CPU cores, the images are tiny (128 px), and every step pays
# halo exchanges, the hand-off and an all-reduce, while the layer rank waits for the tiles (one stage works
# at a time). The split is for images that do *not fit* one device: on a GPU node each rank owns a GPU, a
# 2048-16384 px tile makes compute dominate the halo traffic, and the 4 tiles compute at once (a 2048² conv
# stack runs 1.79x faster on 2 tiles than on one process, BENCHMARKS.md §2b).
#
# ## Memory per rank, next to one process
#
# Measured peak of one step on every rank against the planner's estimate, and the same step on one process:

# %%
from mpi4dl_nb import planner
from mpi4dl_nb.pipeline.reference import serial_step


def measure(images, labels):
    from mpi4dl_nb.planner import measure_engine_step
    return measure_engine_step(eng, images, labels, warmup=0)

measured = cluster.run(measure, *batches[0], timeout=300)
plan = planner.estimate_memory(make_model(), cfg, IMAGE, BATCH, dtype=torch.float64)
one = nn.Sequential(*make_model())
one_opt = optimizer(one.parameters())
serial_memory = planner.measure_step_memory(
    lambda: serial_step(one, one_opt, nn.CrossEntropyLoss(), *batches[0], serial.chunks), [one], one_opt)
print(plan.table())
for rank, (est, got) in enumerate(zip(plan.totals, measured)):
    print(f"rank {rank}: estimate {est / 2**20:6.1f} MB, measured {got / 2**20:6.1f} MB, ratio {est / got:.2f}")
memory_ratio = max(measured) / serial_memory
print(f"one process: {serial_memory / 2**20:.1f} MB; largest rank: {max(measured) / 2**20:.1f} MB "
      f"= {memory_ratio:.2f}x one process")
viz.show(viz.draw_memory_bars(measured, plan.totals))

# %% [markdown]
# Each bar is one rank (measured beside the planner's estimate): the four tile ranks hold a quarter of the
# stem's and blocks' activations (plus their halos), the layer rank only the head and the joined last
# feature map. The largest rank decides whether a configuration fits a device; here it needs well under
# what one process needs. If rank 4's bar towered over the tiles, the cut (`balance`) would be in the wrong
# place: the exercise below shows that case.
#
# The planner computes the same at the resolutions this is made for. It profiles the layers on PyTorch's
# **meta device** (tensors with shapes but no data), so a 2048 px estimate costs no memory:

# %%
for size in (IMAGE, 2048):
    one_process = planner.estimate_memory(make_model(), dl.ParallelConfig(split_size=1, spatial_size=0), size,
                                          BATCH, dtype=torch.float64).peak
    for balance in (BALANCE, (2, 3)):
        ranks = planner.estimate_memory(make_model(), cfg.with_(balance=balance), size, BATCH,
                                        dtype=torch.float64).totals
        print(f"{size:5} px, balance={str(balance):7}: tile rank {ranks[0] / 2**20:8.1f} MB, layer rank "
              f"{ranks[-1] / 2**20:8.1f} MB, one process {one_process / 2**20:8.1f} MB -> largest rank "
              f"{max(ranks) / one_process:.2f}x")

# %% [markdown]
# With the cut after the blocks, the largest rank needs about a quarter of one process at any size; cut
# after block 1 and the layer rank receives a full-resolution feature map and needs over 80% of one
# process: the split would buy little. Choose `balance` so that the spatial stages hold the
# high-resolution layers.
#
# ## Exercise: predict, change a knob, check
#
# For each change below, **Predict** before running: (a) is it still exact? (b) does the largest rank need
# more or less memory than with `balance=(4, 1)`? Then run the cell: every variant trains one step on the
# same 5 ranks and is compared with *its own* serial reference. Edit `VARIANTS` to try others
# (`balance=(2, 3)`: the cut by layer count; `parts=2`: 2 micro-batches per step; `times=1`: GEMS, a mirrored
# replica on the same ranks).

# %%
VARIANTS = [dict(balance=(2, 3)), dict(parts=2), dict(times=1)]

rows = []
for change in VARIANTS:
    variant = cfg.with_(**change)
    cluster.run(setup, variant.as_dict(), timeout=120)
    loss = cluster.run(train_step, *batches[0], timeout=300)[0]      # step 1: its loss
    peak = max(cluster.run(measure, *batches[1], timeout=300))       # step 2: each rank's peak memory
    reference, _, weight_err = compare(variant, [loss], cluster.run(full_state, timeout=120)[0], batches[:2])
    rows.append((change, abs(loss - reference.losses[0]), weight_err, peak))
print(f"{'change':24} {'|loss diff|':>12} {'max |weight diff|':>18} {'largest rank':>13} {'vs one process':>15}")
for change, loss_err, weight_err, peak in rows:
    print(f"{str(change):24} {loss_err:12.1e} {weight_err:18.1e} {peak / 2**20:10.1f} MB "
          f"{peak / serial_memory:14.2f}x")
    assert loss_err < 1e-10 and weight_err < 1e-10, f"{change} is not exact"
cluster.run(setup, cfg.as_dict(), timeout=120)


# %% [markdown]
# Where the time goes (trace of one step):

# %%
def traced(images, labels):
    eng.ctx.tracer.clear()
    eng.train_step(images, labels)
    return eng.timeline(clear=True)

events = cluster.run(traced, *batches[0], timeout=300)[0]
viz.show(viz.draw_timeline(events))

# %% [markdown]
# One row per rank, time to the right, one colour per kind of work (the legend names them). The four tile
# ranks run the spatial stage's forward together (its *halo forward* exchanges inside), the *receive
# activation* on rank 4 is its wait for the tiles' outputs, then rank 4 runs the head; the backward goes the
# other way (*receive gradient* on the tiles, *halo backward*: the halo gradients sent back to the
# neighbours that own those pixels), and the step ends with the gradient all-reduce and the optimizer. The
# gaps are the *bubble*: with one micro-batch only one stage works at a time. `parts` > 1 overlaps the stages
# (notebook 03).

# %% [markdown]
# ## Learning curves: does it learn?
#
# Exact is not the same as useful: is the model any good? A longer run on the same 5 ranks (24 steps of 4
# crops), checked on crops it never trains on. Two things make that check honest here:
#
# * **Whole crops held out.** Each crop appears in 8 rotations/flips; holding out single images would
#   put a turned copy of every held-out crop in training. So the split (seeded, a quarter of each class's
#   crops: `stratified_split` on the crops' labels) takes whole crops, with all their turns
#   (`crops.items(...)`).
# * **Crops that do not overlap.** At `stride=IMAGE` the 512 px image gives 4 x 4 crops side by side,
#   so no held-out pixel is seen in training (the default stride, half a crop, overlaps neighbours).
#
# That leaves 16 crops: 12 to train on, 4 (32 images) held out. The label is the crop's DAB density
# above or below the median crop: the brown of the stain, which the network has to find in the pixels.
# Every 4 steps the held-out crops are evaluated with the training layout (forward only, BatchNorm in
# eval mode; the figures are exact sums over every held-out image). Rank 0 writes one line per step and
# per evaluation to `metrics.jsonl`, which `dl.plot_learning_curves` draws (pass several log folders to
# overlay runs). The learning rate, 0.01 with momentum 0.9, is small enough that BatchNorm's running
# statistics (which evaluation uses) keep up with the weights.

# %%
import tempfile

from mpi4dl_nb.evaluation.log import read_metrics
from mpi4dl_nb.evaluation.split import stratified_split
from mpi4dl_nb.notebook.curves import series

LOG_FOLDER = tempfile.TemporaryDirectory(prefix="mpi4dl-04-curves-")   # removed at the end (or with the kernel)
LOG_DIR = LOG_FOLDER.name
CURVE_STEPS, CURVE_BATCH, EVAL_EVERY, HELD_OUT = 24, 4, 4, 0.25
crops = IHCSampleDataset(IMAGE, num_classes=2, stride=IMAGE)
train_crops, held_crops = stratified_split(crops.crop_labels, HELD_OUT, 0, 2)
held_labels = [crops.crop_labels[c] for c in held_crops]
chance = max(held_labels.count(c) for c in (0, 1)) / len(held_labels)   # always guessing the larger class
print(f"{len(crops.corners)} crops: train on {len(train_crops)}, hold out {held_crops} "
      f"(labels {held_labels}); chance accuracy {chance:.2f}")


def curves_run(log_dir, steps, every, train_items, held_items):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.data import Batcher
    from mpi4dl_nb.data.sample import IHCSampleDataset
    from mpi4dl_nb.evaluation.evaluator import Evaluator
    from mpi4dl_nb.evaluation.log import MetricsLog
    from mpi4dl_nb.evaluation.split import Subset
    from mpi4dl_nb.run.trainer import Trainer, TrainSettings

    ctx = dl.init()
    crops = IHCSampleDataset(IMAGE, num_classes=2, stride=IMAGE)
    engine = dl.HybridEngine(make_model(), eng.cfg, ctx, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
    trainer = Trainer(engine, Batcher(Subset(crops, train_items), CURVE_BATCH), ctx,
                      TrainSettings(steps=steps, progress=False, dtype=torch.float64, eval_every=every),
                      evaluator=Evaluator(engine, Subset(crops, held_items), ctx, len(held_items), torch.float64),
                      log=MetricsLog(log_dir, "notebook-04", tensorboard=False) if ctx.rank == 0 else None)
    summary = trainer.run()
    return None if summary is None else {k: summary[k] for k in ("val_count", "val_loss", "val_accuracy")}

cluster.push({"IMAGE": IMAGE, "CURVE_BATCH": CURVE_BATCH})
held = cluster.run(curves_run, LOG_DIR, CURVE_STEPS, EVAL_EVERY, crops.items(train_crops), crops.items(held_crops),
                   timeout=900)[0]
eval_steps, accuracies = series(read_metrics(LOG_DIR), "eval", "val_accuracy")
learned = accuracies[-1] > max(chance, accuracies[0])
print(f"{held['val_count']} held-out images after {CURVE_STEPS} steps: "
      f"val_loss {held['val_loss']:.4f}, val_accuracy {held['val_accuracy']:.3f}")
print("held-out accuracy by step:", ", ".join(f"{s}: {a:.2f}" for s, a in zip(eval_steps, accuracies)),
      f"-> learns (above chance {chance:.2f} and above the first evaluation): {learned}")
viz.show(dl.plot_learning_curves(LOG_DIR, labels=["SP+LP, 5 ranks"]))

# %% [markdown]
# Left, the loss: training (per step, noisy: 4 crops a step) and held-out (every 4 steps). Right, the
# held-out accuracy (and the balanced accuracy: the mean of the per-class recalls). At the first
# evaluations the model gives every crop the same class, which scores chance (0.5); as the held-out loss
# falls it starts to tell high-DAB crops from low ones. The evaluation uses the same 5 ranks and layout as
# training: no gathering of the model to one process.

# %% [markdown]
# The same curves as a widget: give it several runs' log folders to overlay them, switch train or
# validation curves off, and reread the logs while a batch job is still writing them.

# %%
from mpi4dl_nb.notebook.widgets import LearningCurves

display(LearningCurves([LOG_DIR], labels=["SP+LP, 5 ranks"]).widget)

# %%
summary = {"configuration": cfg.as_dict(), "world_size": cfg.world_size, "image_size": IMAGE,
           "batch_size": BATCH, "steps": STEPS, "exact": bool(exact), "max_loss_error": loss_error,
           "max_weight_error": weight_error, "images_per_second": images_per_second,
           "serial_images_per_second": serial_images_per_second,
           "serial_memory_mb": round(serial_memory / 2**20, 2), "memory_ratio": round(memory_ratio, 3),
           "memory_measured_mb": [round(m / 2**20, 2) for m in measured],
           "memory_estimate_mb": [round(e / 2**20, 2) for e in plan.totals],
           "held_out_steps": eval_steps, "held_out_accuracy": accuracies, "chance_accuracy": chance,
           "held_out_images": held["val_count"], "held_out_crops": len(held_crops),
           "curve_steps": CURVE_STEPS, "curve_batch_size": CURVE_BATCH}
print("MPI4DL_SUMMARY " + json.dumps(summary))
assert memory_ratio <= 0.6, f"the largest rank needs {memory_ratio:.2f}x one process's memory"

# %% [markdown]
# ## What to try next
#
# * Raise `IMAGE` to 256 (and `STEPS` to 2): predict how the one-process memory and the per-tile memory grow
#   (activations grow with the pixel count), then check the ratio in the summary.
# * Try `slice_method="vertical"` (4 strips): halos are longer (a full image height) but only left/right.
# * Set the learning rate to 0.05 in `optimizer` and rerun the learning curves: predict what the held-out
#   loss does. (The training loss still falls; BatchNorm's running statistics, used at evaluation, lag
#   weights that change fast, and the held-out loss can climb.)
# * Notebook 05 asks the planner which configuration fits a memory budget; notebook 06 runs this training
#   as a batch job on your own slides.

# %%
cluster.stop()
LOG_FOLDER.cleanup()   # the learning-curve logs this notebook wrote
