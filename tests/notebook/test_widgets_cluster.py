"""Step-through on a real MPI cluster: the widget releases actions in schedule order and the
engine's runtime reaches exactly those actions; the stepped step equals the serial loss."""

from __future__ import annotations

import pytest
import torch
from ipyparallel import interactive
from torch import nn

from mpi4dl_nb import ParallelConfig
from mpi4dl_nb import cluster as clu
from mpi4dl_nb.notebook.widgets import ClusterStepAgent, StepThrough
from mpi4dl_nb.notebook.widgets.step_agent import action_key

pytestmark = pytest.mark.mpi    # a 3-engine notebook cluster

KNOBS = dict(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2)


def _model():
    import torch

    from mpi4dl_nb.models import build_model  # inside: shipped by value to the engines

    torch.manual_seed(0)
    return [layer.double() for layer in build_model("resnet", num_layers=11, num_filters=4,
                                                      num_classes=2)]


def _batch():
    import torch

    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, 3, 32, 32, generator=generator, dtype=torch.float64),
            torch.tensor([0, 1]))


@interactive
def _setup(knobs, model_fn, batch_fn):
    import torch
    from torch import nn

    import mpi4dl_nb as dl

    global eng, images, labels
    torch.set_num_threads(1)
    ctx = dl.init()
    eng = dl.HybridEngine(model_fn(), dl.ParallelConfig(**knobs), ctx,
                          loss_fn=nn.CrossEntropyLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    images, labels = batch_fn()
    return ctx.rank


def test_step_through_matches_engine_schedule_and_serial_loss():
    images, labels = _batch()
    serial = nn.Sequential(*_model())
    # parts=2: each micro-batch of 1 image goes through the model on its own (BatchNorm
    # statistics per micro-batch), each loss weighted 1/2: the serial meaning of the step.
    with torch.no_grad():
        serial_loss = sum(float(nn.CrossEntropyLoss()(serial(images[i:i + 1]), labels[i:i + 1]))
                          for i in range(2)) / 2
    with clu.start(n=3, call_timeout=120) as cluster:
        # ship the helpers by value (engines cannot import this test module)
        assert cluster.run(_setup, KNOBS, interactive(_model), interactive(_batch)) == [0, 1, 2]
        agent = ClusterStepAgent(cluster, settle=1.0)
        schedule = agent.fetch_schedule()
        assert schedule.cfg == ParallelConfig(**KNOBS)
        stepper = StepThrough(schedule, agent)
        order = schedule.global_order()

        first = stepper.forward()                 # rank 0's forward of its tile: needs a halo
        assert first is order[0] and first.kind == "F" and first.rank == 0
        report = stepper.reports[0]
        assert report is not None and report.rank == 0 and report.mismatches == []
        if not report.settled:                 # waits for tile 1's halo, as it should
            assert "waits for peers" in stepper.details.value
        while stepper.position < len(order) and not (order[stepper.position].rank == 1
                                                     and order[stepper.position].kind == "F"):
            stepper.forward()
        stepper.forward()                         # tile 1's forward: both tiles complete
        tile1 = stepper.reports[stepper.position - 1]
        assert tile1 is not None
        ops = [e.op for e in tile1.events]
        assert "halo" in ops and "F" in ops
        stage_out = dict(tile1.shapes)["stage 0"]   # the tile's output: the vertical half of a square map
        assert stage_out[-2] == 2 * stage_out[-1] and stage_out[0] == 1
        layers = [name for name, _ in tile1.shapes if "layer" in name]
        assert layers[:2] == ["stage 0 layer 0 (ResNetStem)", "stage 0 layer 1 (PreActBottleneck)"]
        assert "halo" in stepper.details.value and "output shape" in stepper.details.value

        stepper.run_to_end()
        assert stepper.position == stepper.executed == len(order)
        assert stepper.error is None
        for rank, final in enumerate(stepper.final):
            assert final.mismatches == [] and final.error is None
            assert final.executed == [action_key(a) for a in schedule.actions(rank)]
            assert final.loss is not None and abs(final.loss - serial_loss) < 1e-12
        assert "step finished on every rank" in stepper.details.value
