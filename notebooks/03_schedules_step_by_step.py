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
# **What you will learn**: how layer parallelism (LP) leaves ranks idle, how pipelining micro-batches
# (GPipe, 1F1B) and GEMS's mirrored replica fill the gaps, what the *bubble* costs and how many
# micro-batches make it small, why 1F1B saves memory and not time; then you will step through a real
# distributed training step action by action.
#
# **What you need**: notebook 01 (stages, rank layout); 3 MPI ranks (started below); about a minute.
#
# A schedule is plain data: per rank, per *tick* (one time slot in which every rank runs at most one
# compute action), forward (`F2`: forward of micro-batch 2) or backward (`B2`) of a stage, the sends and
# receives around them, the gradient all-reduce (`AR`) and the optimizer step (`OPT`). A *micro-batch* is one
# of the `parts` equal slices of the batch. The runtime executes exactly this object, and the step-through
# debugger walks it.

# %%
import torch

import mpi4dl_nb as dl

torch.set_num_threads(1)

# %% [markdown]
# GPipe and 1F1B for 3 stages (one per rank) and 4 micro-batches, then GEMS (`times=1`) on 3 stages:

# %%
from mpi4dl_nb.pipeline import schedules

gpipe, one_f_one_b = schedules.gpipe(3, 4), schedules.one_f_one_b(3, 4)
print(gpipe.table())
print()
print(one_f_one_b.table())
print()
print(schedules.gems(3, 1, times=1).table())


# %% [markdown]
# How to read them:
#
# * **GPipe**: all forwards flow down (rank 0 starts micro-batch 0 at tick 0, rank 2 gets it at tick 2), then
#   all backwards flow back up, last micro-batch first. The empty cells are the **bubble**: ticks where a
#   rank has nothing to do because the stage before (forward) or after (backward) has not handed it
#   anything yet. With `S` stages and `m` micro-batches a rank is idle for `S-1` of every `m+S-1` ticks.
# * **1F1B** takes *the same number of ticks* as GPipe (13 here): its gain is not time but **memory**. Each
#   forward keeps its activations until its backward; GPipe runs all 4 forwards before the first backward,
#   1F1B starts backwards as early as possible so at most `S-s` micro-batches are alive on stage `s`.
# * **GEMS** (`times=1`): a second replica of the model (the *mirror*, primed: `F0'`) is laid on the same
#   ranks in reverse order: rank 0 runs stage 0 of the primary and stage 2 of the mirror (`s0,s2'`), rank 2
#   the other way round, rank 1 stage 1 of both. Each direction gets one micro-batch (half the batch). Both
#   directions start at once, at opposite ends: the step takes 7 compute ticks, where plain LP would run
#   the two halves one after the other in 12 and GPipe with 2 micro-batches in 8. The price: every rank
#   holds the weights of two stages (the replicas' weights stay equal: their gradients are summed).
# * **AR** is the gradient sum over every rank that holds the same stage (tiles, data-parallel copies, a
#   GEMS mirror). On a rank that alone holds its stage (GPipe and 1F1B above) it has nothing to sum and
#   costs nothing. In GEMS, ranks 0 and 2 hold two different stages, each shared with the mirror on the
#   other end (`AR AR`: one sum per stage); rank 1 holds stage 1 in both directions and adds its two copies.

# %%
def live_micro_batches(schedule, rank):
    """Most micro-batches whose forward ran and whose backward has not, on ``rank``, over the step."""
    alive = peak = 0
    for action in schedule.actions(rank):
        alive += {"F": 1, "B": -1}.get(str(action.kind), 0)
        peak = max(peak, alive)
    return peak

for name, schedule in (("GPipe", gpipe), ("1F1B", one_f_one_b)):
    print(f"{name:5}: {schedule.num_ticks} ticks; micro-batches alive at once per rank: "
          f"{[live_micro_batches(schedule, r) for r in range(3)]}")

# %% [markdown]
# The planner turns that into bytes (3 layer stages of a small ResNet, 256 px, batch 8 in 4 micro-batches):

# %%
from mpi4dl_nb import planner
from mpi4dl_nb.models import build_model

resnet = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
for kind in ("gpipe", "1f1b"):
    plan = planner.estimate_memory(resnet, dl.ParallelConfig(split_size=3, spatial_size=0, parts=4, schedule=kind),
                                   256, 8)
    print(f"{kind:5}: per-rank estimate (MB)", [round(total / 2**20, 1) for total in plan.totals])

# %% [markdown]
# ## Exercise: the bubble against the number of micro-batches
#
# **Predict** first: with 3 stages, how much of the step is bubble with 1 micro-batch? with 4? with 16?
# The formula is `(S-1)/(m+S-1)`. The cell counts the idle compute ticks of the *real* GPipe schedule for
# every `m` and plots them against the formula; move the slider (or change `STAGES`) to check your guess.

# %%
import ipywidgets as widgets
from matplotlib.figure import Figure

from mpi4dl_nb import viz


def measured_bubble(schedule):
    """Share of (rank, tick) compute slots without a forward or backward, over the F/B ticks."""
    grid = [[any(str(a.kind) in ("F", "B") for a in cell) for cell in row] for row in schedule.compute_grid()]
    grid = [row for row in grid if any(row)]      # the F/B ticks (not the final AR/OPT tick)
    return 1 - sum(map(sum, grid)) / (len(grid) * len(grid[0]))


STAGES = 3
micro_batches = list(range(1, 17))
bubbles = [measured_bubble(schedules.gpipe(STAGES, m)) for m in micro_batches]
for m, bubble in zip(micro_batches, bubbles):
    assert abs(bubble - schedules.ideal_bubble_fraction(STAGES, m)) < 1e-12, (m, bubble)


def bubble_figure(m):
    figure = Figure(figsize=(6, 3.2))
    ax = figure.add_subplot()
    ax.plot(micro_batches, [schedules.ideal_bubble_fraction(STAGES, k) for k in micro_batches], "-",
            label="(S-1)/(m+S-1)")
    ax.plot(micro_batches, bubbles, "o", label="idle ticks of the GPipe schedule")
    ax.axvline(m, color="grey", linestyle=":")
    ax.set(xlabel="micro-batches m (parts)", ylabel="bubble (idle share)", title=f"{STAGES} stages, m = {m}: "
           f"{schedules.ideal_bubble_fraction(STAGES, m):.0%} idle")
    ax.legend()
    figure.tight_layout()
    return figure


viz.show(bubble_figure(4))

# %% [markdown]
# The same figure with a slider (in JupyterLab): move it to mark another `m`.

# %%
slider = widgets.IntSlider(value=4, min=1, max=16, description="m")
out = widgets.Output()


def redraw(change=None):
    out.clear_output(wait=True)
    with out:
        viz.show(bubble_figure(slider.value))


slider.observe(redraw, names="value")
redraw()
widgets.VBox([slider, out])

# %% [markdown]
# Dots (counted from the schedule) sit on the curve: the formula is exact for equal stages. With 3 stages the
# bubble is 67% at `m = 1` (plain LP: one rank busy at a time), 33% at `m = 4` and 11% at `m = 16`. More
# micro-batches shrink the bubble, but each is smaller (less work per forward, same fixed costs per
# message) and BatchNorm sees smaller batches; on this machine 4-8 is where returns flatten
# (BENCHMARKS.md: 2 stages, 1F1B, 1.51x at m = 4, 1.50x at m = 8).

# %% [markdown]
# ## The step-through debugger
#
# Schedule only (nothing runs): forward walks the global order, back goes back. The configuration has a
# spatial stage of 2 tiles (ranks 0 and 1) and a layer stage (rank 2), with 2 micro-batches. Between them is
# the **hand-off**: the tiles send their outputs to rank 2, which joins them into the full feature map (and
# in the backward splits the gradient into the tiles' boxes and sends each tile its part).

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

# %% [markdown]
# One row per rank, time to the right: ranks 0 and 1 (the tiles) run each micro-batch's forward together,
# rank 2 follows once the hand-off arrives; the gaps are the bubble of this 2-stage pipeline with 2
# micro-batches (predicted: 1/3). The all-reduce at the end sums the two tiles' weight-gradient shares.
# Use the rank/op filters to see how long the sends and receives take compared with the compute.

# %% [markdown]
# ## What to try next
#
# * Set `parts=4` in `cfg` and predict the bubble from the formula before you look at the new timeline.
# * Print `schedules.gems(3, 2, times=1).table()` and find the ticks where no rank is idle.
# * `schedules.build_schedule(cfg).table(show_comm=True)` shows every send (`>peer`) and receive (`<peer`).
# * Notebook 04 trains a 5-rank SP + LP model and checks it against one process.

# %%
cluster.stop()
