"""Zero-bubble ZB-H1 as data (I/W actions, order, dependencies, bubble, refusals); the split backward's exactness."""

from __future__ import annotations

import copy
import doctest

import pytest
import torch
from torch import nn

from mpi4dl_nb.config import ConfigError, ParallelConfig
from mpi4dl_nb.pipeline import zero_bubble as zero_bubble_module
from mpi4dl_nb.pipeline.actions import ActionKind
from mpi4dl_nb.pipeline.schedules import COSTS_SPLIT_EQUAL, Schedule, build_schedule, one_f_one_b, zb1
from mpi4dl_nb.pipeline.split_backward import LayerRecorder, input_backward

F, IN, W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def test_order_docstring_is_real():
    failures, attempted = doctest.testmod(zero_bubble_module, verbose=False)
    assert attempted >= 2 and failures == 0


def compute_ticks(schedule: Schedule) -> dict[tuple[ActionKind, int, int, int, int], int]:
    """(kind, dp, stage, micro-batch, rank) -> tick of every compute action."""
    return {(a.kind, a.dp, a.stage, a.micro_batch, a.rank): a.tick
            for rank in range(schedule.world_size) for a in schedule.actions(rank) if a.kind.is_compute}


@pytest.mark.parametrize("cfg", [
    ParallelConfig(split_size=2, spatial_size=0, parts=4, schedule="zb1"),
    ParallelConfig(split_size=3, spatial_size=0, parts=4, schedule="zb1"),
    ParallelConfig(split_size=4, spatial_size=0, parts=8, schedule="zb1"),
    ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=2, slice_method="vertical", parts=2,
                   schedule="zb1"),
    ParallelConfig(split_size=2, spatial_size=0, data_parallel=2, local_dp=2, parts=3, schedule="zb1"),
], ids=["S2m4", "S3m4", "S4m8", "spatial", "dp2_localdp2"])
def test_every_micro_batch_runs_F_then_I_then_W_on_each_stage_and_waits_for_its_neighbours(cfg):
    schedule = build_schedule(cfg)
    ticks = compute_ticks(schedule)
    assert not any(a.kind is ActionKind.BACKWARD for r in range(schedule.world_size) for a in schedule.actions(r))
    per_stage: dict[tuple[int, int, int], list[ActionKind]] = {}
    for (kind, _dp, stage, u, rank), _ in sorted(ticks.items(), key=lambda item: item[1]):
        per_stage.setdefault((rank, stage, u), []).append(kind)
    copies = cfg.local_dp
    for (rank, stage, u), kinds in per_stage.items():
        per_copy = copies if stage < cfg.spatial_size else 1   # a spatial rank runs every copy's chunk
        assert sorted(kinds, key=[F, IN, W].index) == kinds, (rank, stage, u, kinds)
        assert kinds.count(F) == kinds.count(IN) == kinds.count(W) == per_copy
    last = cfg.split_size - 1
    for (kind, dp, stage, u, rank), tick in ticks.items():
        before = [t for (k, d, s, v, _), t in ticks.items() if d == dp and v == u and (
            (kind is F and k is F and s == stage - 1) or
            (kind is IN and k is IN and s == stage + 1) or
            (kind is IN and stage == last and k is F and s == stage) or
            (kind is W and k is IN and s == stage))]
        assert all(t < tick for t in before), (kind, stage, u, rank)
        if kind is not F or stage > 0:
            assert before, (kind, stage, u)
    for rank in range(schedule.world_size):   # sends and receives carry only what F and I move
        moving = {a.kind for a in schedule.actions(rank) if a.kind.is_p2p}
        assert moving <= {ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD}
        grads = [a for a in schedule.actions(rank) if a.kind in (ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)]
        assert all(ticks[(IN, a.dp, a.stage, a.micro_batch, rank)] == a.tick for a in grads)


@pytest.mark.parametrize("stages,m", [(2, 4), (3, 4), (4, 8), (3, 6)])
def test_idle_time_is_a_third_of_1f1b_with_equal_F_I_W(stages, m):
    """Issue 44's acceptance: F = I = W (1F1B's B = I + W); ZB-H1 idles (S-1) F per rank, 1F1B 3 (S-1) F."""
    zb_span, zb_idle = zb1(stages, m).replay(COSTS_SPLIT_EQUAL)
    span, idle = one_f_one_b(stages, m).replay(COSTS_SPLIT_EQUAL)
    assert zb_idle <= idle / 3 + 1e-9
    assert zb_idle == pytest.approx(stages * (stages - 1))
    assert zb1(stages, m).bubble_share(COSTS_SPLIT_EQUAL) < one_f_one_b(stages, m).bubble_share(COSTS_SPLIT_EQUAL)
    assert zb_span == pytest.approx(3 * m + stages - 1) and span == pytest.approx(3 * (m + stages - 1))


def test_s2_m4_bubble_share():
    """S=2, m=4: 1 idle unit per rank in a 13-unit span (1F1B: 3 in 15)."""
    assert zb1(2, 4).bubble_share(COSTS_SPLIT_EQUAL) == pytest.approx(2 / 26)
    assert one_f_one_b(2, 4).bubble_share(COSTS_SPLIT_EQUAL) == pytest.approx(6 / 30)


@pytest.mark.parametrize("stages,m", [(2, 4), (3, 6), (4, 8)])
def test_in_flight_micro_batches_at_most_1f1b_peak(stages, m):
    """A micro-batch holds activations from its F to its W (1F1B: to its B): stage 0 holds 1F1B's stage-0
    peak (S), no stage more."""
    def peak(schedule: Schedule, rank: int, release: ActionKind) -> int:
        held = top = 0
        for a in schedule.actions(rank):
            held += 1 if a.kind is F else -1 if a.kind is release else 0
            top = max(top, held)
        return top
    for rank in range(stages):
        assert peak(zb1(stages, m), rank, W) <= stages == peak(one_f_one_b(stages, m), 0, ActionKind.BACKWARD)
    assert peak(zb1(stages, m), 0, W) == peak(one_f_one_b(stages, m), 0, ActionKind.BACKWARD)


def test_table_labels_I_and_W():
    table = zb1(2, 4).table()
    assert "I0" in table and "W3" in table and "B" not in table.replace("AR", "")


@pytest.mark.parametrize("knobs,knob", [
    (dict(split_size=2, spatial_size=0, parts=2, times=1, schedule="zb1"), "times"),
    (dict(split_size=3, spatial_size=0, parts=2, schedule="zb1"), "parts"),
    (dict(split_size=4, spatial_size=0, parts=4, schedule="zb1", virtual_stages=2), "virtual_stages"),
    (dict(split_size=2, spatial_size=0, parts=4, schedule="zbv"), "split_size"),   # one position: no V
])
def test_refusals_name_the_knob_and_the_way_out(knobs, knob):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**knobs)
    assert err.value.knob == knob and "use " in str(err.value)


# ------------------------------------------------------------------ split backward
class Gated(nn.Module):
    """A block owning a parameter used around its child layers, with an in-place op after its BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, dtype=torch.float64)
        self.norm = nn.BatchNorm2d(4, dtype=torch.float64)
        self.gate = nn.Parameter(torch.full((1,), 0.7, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu_(self.norm(self.conv(x * self.gate))) + x


def stage_model() -> tuple[nn.Module, nn.Linear]:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4, dtype=torch.float64)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, dtype=torch.float64), nn.ReLU(inplace=True), Gated(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), shared, nn.Tanh(), shared,
                          nn.Linear(4, 2, dtype=torch.float64))
    return model, shared


def test_split_backward_gives_one_backwards_gradients_with_weights_only_in_W():
    model, shared = stage_model()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(2, 2, dtype=torch.float64)
    twin(x_twin).backward(grad_out)
    for step in range(2):   # accumulates over micro-batches like the runtime's
        with LayerRecorder(model).recording() as calls:
            out = model(x if step == 0 else x.detach().requires_grad_(True))
        grads, work = input_backward(calls, [out], [grad_out], [x] if step == 0 else [])
        if step == 0:
            assert len(grads) == 1 and grads[0] is not None and torch.equal(grads[0], x_twin.grad)
            # I: only the module called twice got its parameters' gradients; the rest waits for W
            assert {n for n, p in model.named_parameters() if p.grad is not None} == {"5.weight", "5.bias"}
            assert len(work.layers) == 5   # conv, Gated (its gate), Gated.conv, Gated.norm, last Linear
        work.run()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert p.grad is not None and torch.allclose(p.grad, q.grad * (step + 1), rtol=1e-12, atol=0), name
    assert shared.weight.grad is not None


def test_a_stage_input_that_feeds_nothing_differentiable_gets_no_gradient():
    layer = nn.Linear(3, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with LayerRecorder(layer).recording() as calls:
        out = layer(x.detach())
    grads, work = input_backward(calls, [out.sum()], [None], [x])
    assert grads == [None] and layer.weight.grad is None
    work.run()
    assert layer.weight.grad is not None


def test_no_differentiable_output_means_no_gradients_and_no_W():
    layer = nn.Linear(3, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with LayerRecorder(layer).recording() as calls:
        layer(x)
    grads, work = input_backward(calls, [], [], [x])
    assert grads == [None] and work.layers == [] and layer.weight.grad is None
