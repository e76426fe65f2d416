"""Host reads of the per-step checks: the divergence guard reads one value per step for the whole model (not one
per parameter or buffer), a chunk loss none; the SP -> LP hand-off one for all its replicated tensors; and the
``train`` command (2 tiles + a layer rank, float64) reads as many values per step for a ResNet-8 as a ResNet-20.

On a GPU each read waits for the stream; ``HostReads`` (tests/support/host_reads.py) counts them on CPU.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from torch import nn

from mpi4dl_nb.comm.protocol import Comm
from mpi4dl_nb.comm.trace import Tracer
from mpi4dl_nb.pipeline.actions import Action, ActionKind
from mpi4dl_nb.pipeline.engine import HybridEngine
from mpi4dl_nb.pipeline.handoff import join_tiles
from mpi4dl_nb.run.divergence import LossWatch, NonFiniteGuard, first_nonfinite
from mpi4dl_nb.spatial.geometry import TileGrid
from tests.mpi.train_host_reads import check_name
from tests.support.host_reads import HostReads
from tests.support.mpirun import run_mpi

DEPTHS = (8, 20)


class Canonical(nn.Sequential):
    """A stage's canonical module as the guard reads it (``full_key``: the parameter's name in the full model)."""

    def full_key(self, name: str) -> str:
        return f"model.{name}"


def guarded(layers: int) -> tuple[NonFiniteGuard, Canonical, LossWatch]:
    """A guard over one stage of ``layers`` Linear + BatchNorm pairs, on a one-rank fake context."""
    canonical = Canonical(*(m for _ in range(layers) for m in (nn.Linear(4, 4), nn.BatchNorm1d(4))))
    output = canonical(torch.randn(3, 4))
    assert isinstance(output, torch.Tensor)
    output.sum().backward()
    engine = SimpleNamespace(instances={0: SimpleNamespace(canonical=canonical)}, named_shards=lambda: [])
    ctx = SimpleNamespace(tracer=Tracer(enabled=False), rank=0, all_gather_object=lambda report: [report])
    loss = LossWatch(lambda out, target: torch.as_tensor(out).sum())
    guard = NonFiniteGuard(cast(HybridEngine, engine), cast(Comm, ctx), loss)
    guard.begin_step(1)
    return guard, canonical, loss


def reads_of(run: object) -> int:
    with HostReads() as seen:
        assert callable(run)
        run()
    return sum(seen.reads.values())


@pytest.mark.parametrize("layers", [2, 12])
def test_the_guard_reads_one_value_per_step_whatever_the_model(layers):
    guard, canonical, loss = guarded(layers)
    optim = Action(ActionKind.OPTIM, 0, 1)
    assert reads_of(lambda: [loss(torch.ones(2), None) for _ in range(4)]) == 0     # a chunk loss: no read
    assert reads_of(lambda: guard.on_action(optim)) == 1
    assert guard.bad is None and all(p.grad is not None for p in canonical.parameters())


def test_the_guard_still_names_a_bad_gradient_statistic_and_loss():
    guard, canonical, loss = guarded(3)
    cast(torch.Tensor, canonical[2].weight.grad)[1] = math.nan
    canonical[5].running_var[0] = math.inf
    loss(torch.tensor([math.inf]), None)
    guard.on_action(Action(ActionKind.OPTIM, 0, 1))
    assert guard.bad is not None
    assert "non-finite loss (inf on rank 0" in guard.bad
    assert "(first: model.2.weight on rank 0)" in guard.bad and "model.5.running_var" in guard.bad
    assert all(p.grad is None for p in canonical.parameters())       # the step's update dropped


def test_first_nonfinite_reads_one_value_for_many_tensors():
    state = {f"w{i}": torch.randn(3, dtype=torch.float64 if i % 2 else torch.float32) for i in range(40)}
    assert reads_of(lambda: first_nonfinite([("model", state)])) == 1
    state["w31"][2] = -math.inf
    state["w35"][0] = math.nan
    assert first_nonfinite([("model", state)]) == "model.w31"


def test_a_hand_off_compares_its_replicated_tensors_with_one_read():
    grid = TileGrid(1, 4)
    pooled = [torch.randn(2, 5, dtype=torch.float64) for _ in range(3)]
    tiles = [[p.clone() for p in pooled] for _ in range(4)]
    assert reads_of(lambda: join_tiles(tiles, grid)) == 1
    tiles[3][1] = tiles[3][1] + 1
    with pytest.raises(ValueError, match="2-d tensor that differs between its tiles"):
        join_tiles(tiles, grid)


@pytest.mark.mpi
def test_train_reads_as_many_values_per_step_for_a_resnet_8_as_a_resnet_20():
    """The MPI program asserts at most 6 reads per rank per step; here the counts must also not grow with depth."""
    result = run_mpi(3, "train_host_reads", *DEPTHS, timeout=300, checks=[check_name(d) for d in DEPTHS])
    per_rank = {(r.rank, r.name): r.detail.split(" total=")[0] for r in result.checks.results}
    for rank in range(3):
        assert len({per_rank[(rank, check_name(depth))] for depth in DEPTHS}) == 1, per_rank
