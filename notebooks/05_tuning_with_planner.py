# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 05 — Tuning split and spatial sizes with the planner and measured runs
#
# The planner estimates every rank's peak memory from layer shapes (profiled on PyTorch's
# `meta` device: no memory, any image size) and the schedule; `suggest` ranks the
# configurations that fit a memory budget. Then we measure a few of them on the cluster.

# %%
import torch

import mpi4dl_nb as dl
from mpi4dl_nb import viz

torch.set_num_threads(1)

# %%
from mpi4dl_nb import planner
from mpi4dl_nb.models import build_model

model = build_model("resnet", num_layers=11, num_filters=16, num_classes=2)
IMAGE, BATCH = 128, 2
one = planner.estimate_memory(model, dl.ParallelConfig(split_size=1, spatial_size=0), IMAGE, BATCH)
print(f"one device needs {one.peak / 2**20:.1f} MB")
for s in planner.suggest(model, IMAGE, 0.75 * one.peak, devices=5, batch_size=BATCH, top=8):
    print(s.describe())

# %%
from mpi4dl_nb.notebook.widgets import ConfigPanel

panel = ConfigPanel(model=model, image_size=IMAGE, batch_size=BATCH, devices=5)
panel.set(num_spatial_parts=2, slice_method="vertical")
panel.widget

# %% [markdown]
# Measured on 3 MPI ranks: time per step and peak memory per rank, next to the estimate.

# %%
candidates = [dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical"),
              dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="horizontal", parts=2),
              dict(split_size=3, spatial_size=0, parts=2)]
cluster = dl.cluster.start(n=3)

def run_config(knobs, image, batch):
    import time

    import torch
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.models import build_model
    from mpi4dl_nb.notebook.planner import measure_engine_step
    torch.set_num_threads(1)
    ctx = dl.init()
    torch.manual_seed(0)
    eng = dl.HybridEngine(build_model("resnet", num_layers=11, num_filters=16, num_classes=2),
                          dl.ParallelConfig(**knobs), ctx, loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    x, y = torch.randn(batch, 3, image, image), torch.randint(0, 2, (batch,))
    peak = measure_engine_step(eng, x, y)
    start = time.perf_counter()
    eng.train_step(x, y)
    return peak, time.perf_counter() - start

rows = []
for knobs in candidates:
    c = dl.ParallelConfig(**knobs)
    plan = planner.estimate_memory(model, c, IMAGE, BATCH)
    results = cluster.run(run_config, knobs, IMAGE, BATCH, timeout=300)
    measured = [peak for peak, _ in results]
    seconds = max(t for _, t in results)
    rows.append((knobs, plan.totals, measured, seconds))
    print(knobs, f"step {seconds:.2f} s")
    for rank, (e, m) in enumerate(zip(plan.totals, measured)):
        print(f"   rank {rank}: estimate {e / 2**20:6.1f} MB  measured {m / 2**20:6.1f} MB  ratio {e / m:.2f}")
cluster.stop()

# %%
from matplotlib.figure import Figure

fig = Figure(figsize=(10, 3))
for k, (knobs, est, got, _) in enumerate(rows):
    viz.draw_memory_bars(got, est, ax=fig.add_subplot(1, len(rows), k + 1))
    fig.axes[-1].set_title(", ".join(f"{a}={b}" for a, b in knobs.items() if a != "slice_method"), fontsize=7)
viz.show(fig)
