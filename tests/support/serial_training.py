"""The training a CLI run does, done in one process on whole images: the reference of the MPI exactness programs."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from mpi4dl_nb.data.dataset import Batcher
from mpi4dl_nb.pipeline.reference import serial_accumulated_step, serial_chunks, serial_step
from mpi4dl_nb.run.job_run import JobSetup

Targets = Callable[[Batcher, int, int], torch.Tensor]


def train_one_process(setup: JobSetup, model: torch.nn.Module, loss: torch.nn.Module, targets: Targets,
                      steps: int) -> list[float]:
    """``steps`` optimizer steps of ``model`` (float64) with the run's optimizer, batches, micro-batch chunks and
    accumulation (``--accumulate N``: batches ``N s .. N s + N - 1`` make step ``s``); the losses."""
    training, batcher = setup.record.training, setup.batcher
    assert training is not None and batcher is not None
    optimizer = training.optimizer.build(model.parameters())
    chunks = serial_chunks(setup.job.config, setup.job.training.batch_size)
    accumulate = setup.job.training.accumulate
    losses = []
    for step in range(steps):
        batches = []
        for micro in range(step * accumulate, (step + 1) * accumulate):
            epoch, in_epoch = divmod(micro, batcher.steps_per_epoch)
            batches.append((batcher.images(epoch, in_epoch).to(torch.float64), targets(batcher, epoch, in_epoch)))
        if accumulate == 1:
            losses.append(serial_step(model, optimizer, loss, *batches[0], chunks))
        else:
            losses.append(serial_accumulated_step(model, optimizer, loss, batches, chunks))
    return losses


def matches_one_process(losses: Sequence[float | None], state: Mapping[str, torch.Tensor], serial: Sequence[float],
                        reference: torch.nn.Module | Mapping[str, torch.Tensor], tolerance: float) -> str:
    """Assert a run's ``losses`` and final ``state`` equal one process's (``serial`` losses, ``reference``: its model
    or state dict) within ``tolerance``; the detail line of the check."""
    worst = max(abs(a - b) for a, b in zip([float(v) for v in losses if v is not None], serial))
    assert len(losses) == len(serial) and worst < tolerance, f"{list(losses)} vs {list(serial)}"
    weights = reference.state_dict() if isinstance(reference, torch.nn.Module) else reference
    drift = max((state[k].double() - v.double()).abs().max().item()
                for k, v in weights.items() if v.is_floating_point())
    assert drift < tolerance, f"weights differ by {drift}"
    return f"losses {[round(v, 6) for v in serial]}, max error {worst:.1e}, weights {drift:.1e}"


def classifier_matches_one_process(setup: JobSetup, losses: Sequence[float | None],
                                   state: Mapping[str, torch.Tensor], steps: int, tolerance: float) -> str:
    """A classifier run's ``losses`` and final ``state`` against the run's model trained ``steps`` steps in one
    process (float64, the run's seed, its cross-entropy): ``matches_one_process``'s detail line."""
    torch.manual_seed(setup.job.training.seed)
    model = torch.nn.Sequential(*setup.record.model.build(setup.job.data.image_size)).to(torch.float64)
    loss = setup.record.loss()
    assert isinstance(loss, torch.nn.Module)        # a classifier's cross-entropy
    serial = train_one_process(setup, model, loss, lambda batcher, epoch, step: batcher.labels(epoch, step), steps)
    return matches_one_process(losses, state, serial, model, tolerance)
