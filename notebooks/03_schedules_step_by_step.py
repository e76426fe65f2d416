# ---
# jupyter:
#   kernelspec:
#     display_name: Python (mpi4dl-nb)
#     language: python
#     name: mpi4dl-nb
# ---

# %% [markdown]
# # 03 — Layer, pipeline and GEMS schedules, step by step
#
# A schedule is plain data: per rank, per tick, forward (`F`) or backward (`B`) of a
# micro-batch, sends and receives, the gradient all-reduce (`AR`) and the optimizer step.
# The runtime executes exactly this object — and the step-through debugger walks it.

# %%
import torch

import mpi4dl_nb as dl

torch.set_num_threads(1)

# %%
from mpi4dl_nb.pipeline import schedules

print(schedules.gpipe(3, 4).table())
print()
print(schedules.one_f_one_b(3, 4).table())
print()
print(schedules.gems(2, 1, times=1).table())
print("GPipe bubble with 3 stages and 4 micro-batches:", schedules.ideal_bubble_fraction(3, 4))

# %% [markdown]
# Schedule only (nothing runs): forward walks the global order, back goes back.

# %%
from mpi4dl_nb.notebook.widgets import StepThrough

cfg = dl.ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2)
dry = StepThrough(schedules.build_schedule(cfg))
for _ in range(3):
    dry.forward()
print(dry.text())
dry.widget

# %% [markdown]
# ## Stepping the real thing
#
# Now the same schedule on 3 MPI ranks (2 tiles of a spatial stage + 1 layer stage). Each
# forward click releases one action on its rank: `HybridEngine.train_step` waits before every
# action until the notebook lets it go. A tile's forward waits for its neighbour's halo,
# so it completes when the neighbour's forward is released.

# %%
cluster = dl.cluster.start(n=cfg.world_size)

def setup(knobs, seed=0):
    import torch
    from torch import nn

    import mpi4dl_nb as dl
    from mpi4dl_nb.models import build_model
    global eng, images, labels
    torch.set_num_threads(1)
    ctx = dl.init()
    torch.manual_seed(seed)
    layers = build_model("resnet", num_layers=11, num_filters=4, num_classes=2)
    eng = dl.HybridEngine(layers, dl.ParallelConfig(**knobs), ctx, loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    return ctx.rank

cluster.run(setup, cfg.as_dict(), timeout=120)

# %%
from mpi4dl_nb.notebook.widgets import ClusterStepAgent

agent = ClusterStepAgent(cluster, engine="eng", images="images", labels="labels", settle=1.0)
stepper = StepThrough(agent.fetch_schedule(), agent)
for _ in range(4):
    stepper.forward()
    print(stepper.text())
stepper.widget

# %%
stepper.run_to_end()
print(stepper.text())
assert stepper.error is None


# %% [markdown]
# ## Timeline of a normal step (Gantt per rank from the trace)

# %%
def traced_step():
    eng.ctx.tracer.clear()
    eng.train_step(images, labels)
    return eng.timeline(clear=True)

events = cluster.run(traced_step, timeout=120)[0]
from mpi4dl_nb.notebook.widgets import TimelineView

timeline = TimelineView(events)
timeline.widget

# %%
cluster.stop()
