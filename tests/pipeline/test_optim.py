"""pipeline/optim.py: the optimizer spec every rank builds, and the learning rate as a pure function of the step."""
from __future__ import annotations

import math

import pytest
import torch

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.pipeline.optim import LRSchedule, LRScheduleKind, OptimizerKind, OptimizerSpec


def rates(schedule: LRSchedule, peak: float = 1.0) -> list[float]:
    return [peak * schedule.factor(s) for s in range(schedule.total_steps)]


def test_warm_up_is_linear_and_never_zero():
    assert rates(LRSchedule(LRScheduleKind.CONSTANT, 6, 2)) == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])


def test_cosine_starts_at_the_peak_after_warm_up_and_ends_near_zero():
    values = rates(LRSchedule(LRScheduleKind.COSINE, 10, 2))
    assert values[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert values[3:] == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(1, 8)])
    assert all(a > b for a, b in zip(values[2:], values[3:])) and 0 < values[-1] < 0.04


def test_step_decay_every_third_by_default_or_every_n():
    assert rates(LRSchedule(LRScheduleKind.STEP, 9)) == pytest.approx([1, 1, 1, .1, .1, .1, .01, .01, .01])
    assert rates(LRSchedule(LRScheduleKind.STEP, 5, 1, step_size=2, gamma=0.5)) == pytest.approx(
        [0.5, 1, 1, 0.5, 0.5])


def test_apply_sets_the_rate_from_the_peak_every_time():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.2)
    schedule = LRSchedule(LRScheduleKind.COSINE, 6, 1)
    seen = []
    for step in range(6):
        schedule.apply(optimizer, step)
        seen.append(optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx(rates(schedule, 0.2))
    fresh = torch.optim.SGD([param], lr=0.2)     # a resumed run: a new optimizer at step 4
    schedule.apply(fresh, 4)
    assert fresh.param_groups[0]["lr"] == seen[4]
    schedule.apply(None, 3)                      # no optimizer (a rank without parameters): nothing to set


@pytest.mark.parametrize("kwargs,knob", [
    (dict(total_steps=4, warmup_steps=4), "--warmup-steps"), (dict(total_steps=4, warmup_steps=-1), "--warmup-steps"),
    (dict(total_steps=0), "--steps"), (dict(total_steps=4, step_size=0), "--lr-step-size"),
    (dict(total_steps=4, gamma=0.0), "--lr-gamma"), (dict(total_steps=4, gamma=1.5), "--lr-gamma")])
def test_bad_schedules_name_their_flag(kwargs, knob):
    with pytest.raises(ConfigError, match=knob):
        LRSchedule(**kwargs)


def test_optimizer_defaults_per_kind_and_what_they_build():
    sgd = OptimizerSpec.of("sgd", 0.1)
    assert (sgd.momentum, sgd.weight_decay, sgd.state_slots) == (0.9, 0.0, 1)
    adamw = OptimizerSpec.of(OptimizerKind.ADAMW, 0.001)
    assert (adamw.momentum, adamw.weight_decay, adamw.state_slots) == (0.0, 0.01, 2)
    params = [torch.nn.Parameter(torch.ones(3))]
    built = adamw.build(params)
    assert isinstance(built, torch.optim.AdamW) and built.defaults["weight_decay"] == 0.01
    assert built.defaults["lr"] == 0.001 and built.defaults["betas"] == (0.9, 0.999)
    assert isinstance(sgd.build(params), torch.optim.SGD) and sgd.build(params).defaults["momentum"] == 0.9
    assert OptimizerSpec.of("sgd", 0.1, momentum=0.0).state_slots == 0
    for spec in (sgd, adamw, OptimizerSpec.of("sgd", 0.5, 0.5, 1e-4)):
        assert OptimizerSpec.from_dict(spec.to_dict()) == spec
    assert "weight decay 0.01" in adamw.describe() and "momentum 0.9" in sgd.describe()


def test_adamw_with_momentum_and_bad_numbers_are_refused():
    with pytest.raises(ConfigError, match="--momentum.*AdamW"):
        OptimizerSpec.of("adamw", 0.01, momentum=0.9)
    with pytest.raises(ConfigError, match="--weight-decay"):
        OptimizerSpec.of("sgd", 0.01, weight_decay=-1)
    with pytest.raises(ConfigError, match="--lr"):
        OptimizerSpec.of("sgd", float("nan"))


def test_schedule_round_trip_and_description():
    schedule = LRSchedule(LRScheduleKind.STEP, 30, 3, step_size=5, gamma=0.5)
    assert LRSchedule.from_dict(schedule.to_dict()) == schedule
    assert LRSchedule(LRScheduleKind.COSINE, 80, 2).describe() == "cosine over 80 steps, warm-up 2"
    assert LRSchedule().describe() == "constant"      # constant: its length is no part of what it is
    with pytest.raises(ValueError, match="kind"):
        LRSchedule.from_dict({"kind": "linear", "total_steps": 3})
