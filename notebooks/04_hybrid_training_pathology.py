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
# The flagship: a ResNet (v2) whose first stage runs spatially on 4 tiles (2x2) and whose
# second stage runs on a fifth rank — 5 MPI ranks. We train a few steps on crops of a real
# IHC-stained tissue image in float64 and compare loss, and every weight after the updates,
# with the same model trained in this notebook on one process.

# %%
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz

torch.set_num_threads(1)

# %%
import json

import numpy as np
from torch import nn

from mpi4dl_nb.data.sample import IHCSampleDataset

IMAGE, BATCH, STEPS, DEPTH, WIDTH = 128, 2, 3, 11, 8
cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square")
data = IHCSampleDataset(IMAGE, num_classes=2)
picks = [[(7 * (step * BATCH + i)) % len(data) for i in range(BATCH)] for step in range(STEPS)]
batches = [(torch.stack([data.read(i) for i in idx]).double(), torch.tensor([data.label(i) for i in idx]))
           for idx in picks]
print(cfg.world_size, "ranks:", cfg.describe_world(), "| dataset:", len(data), "crops")
viz.show(viz.draw_rank_layout(cfg))
grid = dl.TileGrid.from_slice_method(cfg.slice_method, cfg.num_spatial_parts)
first = grid.layer_halo(IMAGE, IMAGE, kernel=3, padding=1, name="stem conv 3x3")
viz.show(viz.draw_tiles_and_halos(batches[0][0][0], grid, first))


# %%
def make_model():
    import torch

    from mpi4dl_nb.models import build_model
    torch.manual_seed(0)
    return [layer.double() for layer in build_model("resnet", num_layers=DEPTH, num_filters=WIDTH, num_classes=2)]

def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)

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
print("losses:", parallel_losses, f"| {images_per_second:.2f} images/s")

# %% [markdown]
# The same training on one process:

# %%
serial = nn.Sequential(*make_model())
serial_opt = optimizer(serial.parameters())
serial_losses = []
for images, labels in batches:
    serial_opt.zero_grad(set_to_none=True)
    loss = nn.CrossEntropyLoss()(serial(images), labels)
    loss.backward()
    serial_opt.step()
    serial_losses.append(loss.item())

def full_state():
    return eng.full_state_dict()

parallel_state = cluster.run(full_state, timeout=120)[0]
serial_state = serial.state_dict()
loss_error = max(abs(a - b) for a, b in zip(parallel_losses, serial_losses))
weight_error = max(float((parallel_state[k].double() - v.double()).abs().max()) for k, v in serial_state.items())
exact = loss_error < 1e-10 and weight_error < 1e-10
print(f"max |loss difference| = {loss_error:.2e}, max |weight difference| = {weight_error:.2e} "
      f"over {len(serial_state)} tensors (weights, BatchNorm statistics) -> exact: {exact}")
assert exact

# %% [markdown]
# Per-rank memory: measured peak of one step against the planner's estimate:

# %%
from mpi4dl_nb import planner


def measure(images, labels):
    from mpi4dl_nb.notebook.planner import measure_engine_step
    return measure_engine_step(eng, images, labels, warmup=0)

measured = cluster.run(measure, *batches[0], timeout=300)
plan = planner.estimate_memory(make_model(), cfg, IMAGE, BATCH, dtype=torch.float64)
print(plan.table())
for rank, (est, got) in enumerate(zip(plan.totals, measured)):
    print(f"rank {rank}: estimate {est / 2**20:6.1f} MB, measured {got / 2**20:6.1f} MB, ratio {est / got:.2f}")
viz.show(viz.draw_memory_bars(measured, plan.totals))


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
# ## Learning curves
#
# Is the model any good? A short run on the same 5 ranks with a few crops held out: a seeded split
# that keeps each class's share (`--val-fraction` on the command line), evaluated every 2 steps with
# the training layout (forward only, BatchNorm in eval mode; the figures are exact sums over every
# held-out crop). Rank 0 writes one line per step and per evaluation to `metrics.jsonl`, which
# `dl.plot_learning_curves` draws (pass several log folders to overlay runs).

# %%
import tempfile

LOG_DIR = tempfile.mkdtemp(prefix="mpi4dl-04-curves-")
CURVE_STEPS, EVAL_EVERY, HELD_OUT = 6, 2, 0.02


def curves_run(log_dir, steps, every, fraction):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.data import Batcher
    from mpi4dl_nb.data.sample import IHCSampleDataset
    from mpi4dl_nb.evaluation.evaluator import Evaluator
    from mpi4dl_nb.evaluation.log import MetricsLog
    from mpi4dl_nb.evaluation.split import Subset, stratified_split
    from mpi4dl_nb.run.train import Trainer, TrainSettings

    ctx = dl.init()
    crops = IHCSampleDataset(IMAGE, num_classes=2)
    train_part, held_out = stratified_split([crops.label(i) for i in range(len(crops))], fraction, 0, 2)
    engine = dl.HybridEngine(make_model(), eng.cfg, ctx, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
    trainer = Trainer(engine, Batcher(Subset(crops, train_part), BATCH), ctx,
                      TrainSettings(steps=steps, progress=False, dtype=torch.float64, eval_every=every),
                      evaluator=Evaluator(engine, Subset(crops, held_out), ctx, len(held_out), torch.float64),
                      log=MetricsLog(log_dir, "notebook-04", tensorboard=False) if ctx.rank == 0 else None)
    summary = trainer.run()
    return None if summary is None else {k: summary[k] for k in ("val_count", "val_loss", "val_accuracy")}

cluster.push({"IMAGE": IMAGE, "BATCH": BATCH})
held = cluster.run(curves_run, LOG_DIR, CURVE_STEPS, EVAL_EVERY, HELD_OUT, timeout=600)[0]
print(f"{held['val_count']} held-out crops after {CURVE_STEPS} steps: "
      f"val_loss {held['val_loss']:.4f}, val_accuracy {held['val_accuracy']:.3f}")
viz.show(dl.plot_learning_curves(LOG_DIR, labels=["SP+LP, 5 ranks"]))

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
           "memory_measured_mb": [round(m / 2**20, 2) for m in measured],
           "memory_estimate_mb": [round(e / 2**20, 2) for e in plan.totals]}
print("MPI4DL_SUMMARY " + json.dumps(summary))
cluster.stop()
