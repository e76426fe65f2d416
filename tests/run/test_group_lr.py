"""Per-group learning rates recorded (issue 81): every ``--layer-decay`` group named (embedding, block.i, head) by
BEiT's rule; every rank's groups gathered once, so rank 0's metrics.jsonl has each group's ``lr/<name>`` = the run's
rate x its scale, and TensorBoard ``train/lr/<name>``; the checkpoint's record lists the groups (a record from before
it: none). Through the command line and export: tests/cli/test_export_preset.py; on a pipeline:
tests/mpi/foundation_exact.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord
from mpi4dl_nb.data.apps import AppKind
from mpi4dl_nb.evaluation.log import RecordKind, tensorboard_scalars
from mpi4dl_nb.models.vit import layer_decay_scales
from mpi4dl_nb.pipeline.layer_decay import (
    NAME,
    RateGroup,
    ScaledOptimizer,
    gathered_groups,
    group_names,
    group_rates,
    local_groups,
    make_optimizer,
    rate_records,
)
from mpi4dl_nb.pipeline.optim import OptimizerSpec
from tests.pipeline.test_layer_decay import DEPTH, LR, F, tiny_vit


class Gathered:
    """A comm whose ``gather_object`` hands rank 0 the given ranks' objects (this rank's first)."""

    def __init__(self, rank: int, others: list[object]) -> None:
        self.rank, self.others = rank, others

    def gather_object(self, obj: object, root: int = 0) -> list[object] | None:
        return [obj, *self.others] if self.rank == root else None


def test_every_group_is_named_by_its_layers():
    layers = tiny_vit()
    scales = layer_decay_scales(layers, F, "the ViT")
    names = group_names(scales)
    blocks = [i for i, layer in enumerate(layers) if any(k.startswith("blocks.") for k in layer.state_dict())]
    for key, scale in scales.items():
        layer = int(key.split(".")[0])
        expected = (f"block.{blocks.index(layer)}" if layer in blocks
                    else "embedding" if layer < blocks[0] else "head")
        assert names[scale] == expected, key
    assert len(set(names.values())) == DEPTH + 2
    assert group_names(dict.fromkeys(scales, 1.0)) == {1.0: "all"}           # a factor of 1: one group


def test_each_rank_s_groups_gathered_once_give_every_group_s_rate():
    layers = tiny_vit()
    scaled = ScaledOptimizer(OptimizerSpec.of("sgd", LR, layer_decay=F), layer_decay_scales(layers, F, "the ViT"))
    named = list(nn.Sequential(*layers).named_parameters())
    first = make_optimizer(scaled, [(k, p) for k, p in named if int(k.split(".")[0]) <= 1])    # stage 0's layers
    last = make_optimizer(scaled, [(k, p) for k, p in named if int(k.split(".")[0]) > 1])
    assert [g[NAME] for g in first.param_groups] == ["block.0", "embedding"]      # the largest scale first
    groups = gathered_groups(first, Gathered(0, [local_groups(last), local_groups(first)]))   # a replica too
    expected = ["embedding", *(f"block.{i}" for i in range(DEPTH)), "head"]
    assert [name for name, _ in groups] == expected
    assert gathered_groups(last, Gathered(1, [])) == []
    rates = group_rates(groups, 0.5 * LR)
    assert list(rates) == [f"lr/{name}" for name in expected]
    assert rates == {f"lr/{name}": pytest.approx(0.5 * LR * F ** (DEPTH + 1 - j)) for j, name in enumerate(expected)}
    plain = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=LR)
    assert local_groups(plain) == [("all", 1.0)] and group_rates(local_groups(plain), LR) == {}
    assert group_rates(groups, None) == {} and rate_records(groups, None) == ()
    records = rate_records(groups, LR)
    assert [(r.name, r.lr) for r in records] == [(name, pytest.approx(LR * scale)) for name, scale in groups]


def test_tensorboard_gets_each_group_s_rate():
    record = {"kind": "train", "step": 3, "loss": 0.5, "lr": 0.1, "lr/embedding": 0.025, "lr/block.0": 0.05}
    scalars = tensorboard_scalars(RecordKind.TRAIN, record)
    assert scalars["train/lr/embedding"] == 0.025 and scalars["train/lr/block.0"] == 0.05
    assert scalars["train/lr"] == 0.1 and "eval/lr/block.0" not in tensorboard_scalars(RecordKind.EVAL, record)


def test_the_record_keeps_the_groups_and_an_older_one_reads_with_none():
    from mpi4dl_nb.models.spec import ModelSpec

    groups = (RateGroup("embedding", 0.25, 0.025), RateGroup("head", 1.0, 0.1))
    record = RunRecord(ModelSpec.of("resnet"), DataRecord(AppKind.SYNTHETIC, 32, 2), param_groups=groups)
    payload = record.to_payload()
    assert RunRecord.from_payload(payload, "c.pt").param_groups == groups
    older = {**payload, "record": {k: v for k, v in payload["record"].items() if k != "param_groups"}}
    assert RunRecord.from_payload(older, "c.pt").param_groups == ()
    broken = {**payload, "record": {**payload["record"], "param_groups": [{"name": "head", "lr": "fast"}]}}
    with pytest.raises(ValueError, match="param_groups"):
        RunRecord.from_payload(broken, "c.pt")
