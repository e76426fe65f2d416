"""MPI (5 ranks): evaluation with the training layout equals one process and leaves every state as it was.

For SP+LP (4 tiles + 1), GEMS on 5 stages, and 5 data-parallel replicas, in float64: one SGD
step with momentum (so BatchNorm running statistics, gradients and momentum buffers are real),
then the Evaluator on 13 images (the last batch padded). Checks: per-sample predictions
identical and losses equal (1e-12) to a serial eval-mode forward of the same weights (the
model has a Dropout layer: in train mode it would differ), the metrics equal serial ones,
and every parameter, buffer, gradient, optimizer state and training flag is unchanged.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn

import mpi4dl_nb as dl
from mpi4dl_nb.data import SyntheticDataset
from mpi4dl_nb.evaluation.evaluator import Evaluator
from mpi4dl_nb.evaluation.metrics import Records, summarize
from tests.support.checks import Checks, run_checks
from tests.support.models import small_resnet
from tests.support.planes import split_backend

SIZE, SAMPLES = 16, 13
CONFIGS = {
    "sp+lp": (dict(split_size=2, spatial_size=1, num_spatial_parts=4, balance=(2, 4)), 4),
    "gems": (dict(split_size=5, spatial_size=0, times=1, balance=(1, 1, 1, 1, 2)), 4),
    "dp5": (dict(split_size=1, spatial_size=0, data_parallel=5), 5),
}
CHECKS = tuple(f"{name} {what}" for name in CONFIGS for what in ("equals serial", "touches no state"))
REFUSED = tuple(f"{name} refuses dropout in training" for name in ("gems", "dp5"))   # replicas: pipeline/stage_draws.py


def model() -> list[nn.Module]:
    layers = small_resnet(seed=0, num_classes=2)
    layers = [*layers[:-1], nn.Dropout(0.5), layers[-1]]
    return [layer.double() for layer in layers]


def serial_records(state: dict[str, torch.Tensor], dataset: SyntheticDataset) -> Records:
    net = nn.Sequential(*model())
    net.load_state_dict(state)
    net.eval()
    images = torch.stack([dataset.read(i) for i in range(len(dataset))]).double()
    labels = torch.tensor([dataset.label(i) for i in range(len(dataset))])
    with torch.no_grad():
        logits = net(images)
    loss = nn.functional.cross_entropy(logits, labels, reduction="none")
    return Records(np.arange(len(dataset)), labels.numpy(), loss.numpy(), logits.numpy())


def snapshot(engine: dl.HybridEngine) -> list[tuple[str, object]]:
    """Every tensor and flag evaluation must not touch, on this rank."""
    out: list[tuple[str, object]] = []
    for key, inst in sorted(engine.instances.items()):
        for root in (inst.canonical, inst.module):
            out += [(f"{key} {name} mode", m.training) for name, m in root.named_modules()]
        for name, t in inst.canonical.state_dict(keep_vars=True).items():
            out.append((f"{key} {name}", t.detach().clone()))
            if isinstance(t, nn.Parameter):
                out.append((f"{key} {name}.grad", None if t.grad is None else t.grad.clone()))
    assert engine.optimizer is not None
    for i, state in enumerate(engine.optimizer.state.values()):
        out += [(f"optimizer {i} {k}", v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()]
    return out


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def refused_on_replicas(cfg: dl.ParallelConfig, ctx: dl.Context) -> None:
    """Training the model (its dropout drawing) on replicas is refused on every rank before any work
    (``pipeline/stage_draws.py``: each replica would draw the masks of other samples from the same state)."""
    try:
        dl.HybridEngine(model(), cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    except dl.ConfigError as error:
        assert "replica" in str(error) and "(first: " in str(error), str(error)
        return
    raise AssertionError("training with dropout on replicas was not refused")


def main(check: Checks) -> None:
    torch.set_num_threads(1)
    backend, names = split_backend(sys.argv[1:], default="auto")   # names: a subset of CONFIGS
    ctx = dl.init(backend=backend)
    dataset = SyntheticDataset(SIZE, 2, SAMPLES, seed=3)
    train_images = torch.stack([dataset.read(i) for i in range(10)]).double()
    train_labels = torch.tensor([dataset.label(i) for i in range(10)])
    for name, (knobs, batch) in CONFIGS.items():
        if names and name not in names:
            continue
        cfg = dl.ParallelConfig(**knobs)
        layers = model()
        dropout = layers[-2]
        assert isinstance(dropout, nn.Dropout)
        replicated = cfg.data_parallel > 1 or cfg.gems   # their dropout draws in training are refused: p=0 there
        if replicated:
            with check(f"{name} refuses dropout in training"):
                refused_on_replicas(cfg, ctx)
        dropout.p = 0.0 if replicated else 0.5
        engine = dl.HybridEngine(layers, cfg, ctx, loss_fn=nn.CrossEntropyLoss(),
                                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        engine.train_step(train_images[:batch], train_labels[:batch])
        dropout.p = 0.5   # evaluation must still turn the dropout off
        state = ctx.bcast_object(engine.full_state_dict(), root=0)
        before = snapshot(engine)
        evaluator = Evaluator(engine, dataset, ctx, batch, torch.float64)
        with check(f"{name} equals serial") as result:
            records = evaluator.records()
            metrics = ctx.bcast_object(summarize(records, 2) if records is not None else None, root=0)
            serial = serial_records(state, dataset)
            expected = summarize(serial, 2)
            if records is not None:
                assert np.array_equal(records.index, serial.index)
                assert np.array_equal(records.predicted, serial.predicted), "predictions differ"
                err = float(np.abs(records.loss - serial.loss).max())
                assert err < 1e-12, f"per-sample loss differs by {err}"
                result.detail = f"max per-sample loss error {err:.1e}"
            assert abs(metrics.loss - expected.loss) < 1e-9
            assert {k: v for k, v in metrics.as_dict().items() if k != "loss"} == \
                {k: v for k, v in expected.as_dict().items() if k != "loss"}
            assert evaluator.run() == metrics
        with check(f"{name} touches no state"):
            after = snapshot(engine)
            assert [k for k, _ in before] == [k for k, _ in after]
            changed = [k for (k, a), (_, b) in zip(before, after) if not same(a, b)]
            assert not changed, f"evaluation changed {changed[:5]}"


if __name__ == "__main__":
    run_checks(main)
