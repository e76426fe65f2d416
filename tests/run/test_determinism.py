"""Exactness runs switch on torch's deterministic algorithms (float64, or ``--deterministic on``), say so in the JSON
summary, and put the previous setting back; an op with no deterministic form is refused by name; the window
exchange's accumulation adds in a fixed order on every device."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from mpi4dl_nb.comm.determinism import Determinism, deterministic_run
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.trainer import Trainer
from mpi4dl_nb.spatial.windows.exchange import Route
from tests.support.train_in_process import run_train

SMALL = ["--model", "resnet", "--num-layers", "8", "--num-filters", "4", "--image-size", "16", "--batch-size", "2",
         "--num-samples", "4", "--split-size", "1", "--spatial-size", "0", "--steps", "1", "--no-progress"]
CUDA_REFUSAL = ("adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, but you set "
                "'torch.use_deterministic_algorithms(True)'.")


def switches() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic


@pytest.fixture
def during_steps(monkeypatch):
    """The switches as each training step saw them; the process's own put back after the test whatever it did."""
    seen: list[tuple[bool, bool]] = []
    original = Trainer.train_one

    def train_one(self: Trainer) -> float:
        seen.append(switches())
        return original(self)

    monkeypatch.setattr(Trainer, "train_one", train_one)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = switches()
    yield seen
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic = before[1]


@pytest.mark.parametrize(("flags", "on"), [(["--dtype", "float64"], True), (["--dtype", "float32"], False),
                                           (["--dtype", "float32", "--deterministic", "on"], True),
                                           (["--dtype", "float64", "--deterministic", "off"], False)])
def test_a_train_run_says_whether_it_was_deterministic_and_steps_ran_so(capsys, during_steps, flags, on):
    assert switches() == (False, False)
    code, out, err = run_train([*SMALL, *flags], capsys)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["deterministic"] is on
    assert during_steps == [(on, on)]
    assert switches() == (False, False)                      # put back after the run
    assert (os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8") is on


def test_an_op_without_a_deterministic_form_is_refused_by_name():
    unpool = nn.MaxUnpool2d(2)          # torch has no deterministic form of it, on CPU either
    x, where = torch.ones(1, 1, 2, 2), torch.zeros(1, 1, 2, 2, dtype=torch.long)
    with pytest.raises(ConfigError) as refused, deterministic_run(Determinism.AUTO, torch.float64):
        unpool(x, where)
    assert refused.value.knob == "--deterministic"
    assert "max_unpooling2d_forward_out has no deterministic form" in str(refused.value)
    assert "--deterministic off" in str(refused.value)
    with pytest.raises(ConfigError, match="adaptive_avg_pool2d_backward_cuda has no"), \
            deterministic_run(Determinism.ON, torch.float32):
        raise RuntimeError(CUDA_REFUSAL)                     # what torch raises on a GPU
    with deterministic_run(Determinism.OFF, torch.float64) as on:
        assert not on and unpool(x, where).shape == (1, 1, 4, 4)
    with pytest.raises(RuntimeError, match="another failure"), deterministic_run(Determinism.ON, torch.float32):
        raise RuntimeError("another failure")                # other errors pass through as they were
    assert switches() == (False, False)


def test_the_window_exchange_adds_a_slot_s_values_in_order_without_cuda_s_atomic_index_add(monkeypatch):
    """A gather's adjoint that reads slot 1 three times: the sum is exact on CPU (``index_add_``, serial); off the
    CPU (a meta tensor standing for CUDA) the route takes ``index_put_(accumulate=True)``, never ``index_add_``."""
    values = torch.tensor([[[1e16], [1.0], [-1e16], [5.0]]], dtype=torch.float64)
    route = Route.build(3, ([0, 1, 2, 3], [1, 1, 1, 0]), [], [], torch.device("cpu"))
    assert route.accumulate
    assert route.local(values)[0, :, 0].tolist() == [5.0, (1e16 + 1.0) - 1e16, 0.0]   # in slot order: 0 + 1 + ...
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda *args: pytest.fail("index_add_ off the CPU"))
    meta = Route.build(3, ([0, 1, 2, 3], [1, 1, 1, 0]), [], [], torch.device("meta"))
    assert meta.local(values.to("meta")).shape == (1, 3, 1)
