"""Layer timing: many layers timed together in interleaved rounds, so a slow spell of the machine
falls on every layer alike and each layer's median leaves it out; suggest and the one-knob sweep
time all their configurations' layers in one measurement."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.models import build_model
from mpi4dl_nb.planner.device import TimingRequest
from mpi4dl_nb.planner.footprint import StageRole
from mpi4dl_nb.planner.layer_timer import WALL_ROUNDS, WALL_SPREAD_SECONDS, LayerTimer, timed_rounds
from mpi4dl_nb.planner.step_time import step_model, time_layers
from tests.planner.recording import flop_timer

BASE, SPELL = 0.002, 0.03      # seconds a forward takes; extra seconds during a slow spell


class Calls(list):
    """The forward calls of every Sleeper, in order; shared by the timer's copies of the layers."""

    def __deepcopy__(self, memo: dict) -> Calls:
        return self


def busy(seconds: float) -> None:
    """Compute for ``seconds`` of this thread's CPU time (the planner's clock on one CPU thread)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Sleeper(nn.Module):
    """A layer whose forward takes ``BASE`` seconds, ``SPELL`` more while the shared count of
    forward calls is inside ``spell`` (a slow spell, counted in calls): busy, not asleep, as the
    timer reads a CPU thread's own seconds."""

    def __init__(self, name: str, calls: Calls, spell: range, width: int) -> None:
        super().__init__()
        self.name, self.calls, self.spell = name, calls, spell
        self.scale = nn.Parameter(torch.ones(width))   # a distinct structure per layer (its own timing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slow = len(self.calls) in self.spell
        self.calls.append(self.name)
        busy(BASE + (SPELL if slow else 0.0))
        return x * self.scale.view(1, -1, 1, 1)


def requests(layers: list[Sleeper]) -> list[TimingRequest]:
    return [TimingRequest(layer, ((1, layer.scale.numel(), 4, 4),), torch.float32, StageRole()) for layer in layers]


def test_layers_timed_together_run_in_rounds_and_a_slow_spell_is_left_out():
    calls = Calls()
    spell = range(6, 10)                       # forward calls 6-9: two rounds of three layers
    layers = [Sleeper(name, calls, spell, width) for name, width in (("a", 2), ("b", 3), ("c", 5))]
    timer = LayerTimer("cpu", repeats=5)
    timer.measure(requests(layers))
    assert calls == ["a", "b", "c"] * 6 and timer.profiled == 3      # warm-up round + 5 rounds, interleaved
    together = [timer.layer(r.layer, r.shapes, r.dtype, r.role) for r in requests(layers)]
    assert len(calls) == 18 and timer.profiled == 3                  # answered from memory
    assert all(BASE <= t.forward < BASE + SPELL / 2 for t in together)

    # the same spell on layers timed one after another falls on all of one layer's runs but one
    calls.clear()
    alone = LayerTimer("cpu", repeats=5)
    found = {r.layer.name: alone.layer(r.layer, r.shapes, r.dtype, r.role) for r in requests(layers)}
    assert calls == ["a"] * 6 + ["b"] * 6 + ["c"] * 6
    assert found["b"].forward > BASE + SPELL / 2 and found["a"].forward < BASE + SPELL / 2


def test_on_the_wall_clock_short_rounds_are_spread_over_a_second_so_a_spell_is_left_out():
    # a CPU running two torch threads times layers by the wall clock, which counts whatever else runs meanwhile
    assert timed_rounds(5, 0.04, wall=True) == 25 and timed_rounds(5, 0.001, wall=True) == WALL_ROUNDS
    assert timed_rounds(5, 0.04, wall=False) == 5 and timed_rounds(5, WALL_SPREAD_SECONDS, wall=True) == 5
    calls = Calls()
    spell = range(3, 3 + 3 * 10)         # the first 10 timed rounds slow: all 5 of the rounds a thread's clock takes
    layers = [Sleeper(name, calls, spell, width) for name, width in (("a", 2), ("b", 3), ("c", 5))]
    timer = LayerTimer("cpu", repeats=5, threads=2)
    timer.measure(requests(layers))
    rounds = len(calls) // 3 - 1
    assert calls == ["a", "b", "c"] * (rounds + 1) and 20 < rounds <= WALL_ROUNDS, rounds
    found = [timer.layer(r.layer, r.shapes, r.dtype, r.role) for r in requests(layers)]
    assert all(t.forward < BASE + SPELL / 2 for t in found), found


@pytest.fixture(scope="module")
def resnet():
    return build_model("resnet", num_layers=11, num_filters=8, num_classes=2)


def test_suggest_times_every_candidate_s_layers_in_one_measurement(resnet):
    timer, node = flop_timer(), planner.Node(cores=2, copy_bandwidth=1e10)
    one = planner.estimate_memory(resnet, ParallelConfig(split_size=1, spatial_size=0), 64, 2).peak
    found = planner.suggest(resnet, 64, 0.9 * one, 5, batch_size=2, top=None, timer=timer, node=node)
    assert len(found) > 3 and timer.bench.layer_batches == [timer.profiled]   # one measurement, none after
    models = [step_model(resnet, s.cfg, 64, 2, node=node, timer=timer) for s in found]
    time_layers(models)
    assert timer.bench.layer_batches == [timer.profiled]                       # all known: nothing measured again
    assert [m.predict().seconds for m in models] == [s.est_step_time for s in found]
    fresh = flop_timer()
    alone = planner.predict_step_time(resnet, found[0].cfg, 64, 2, node=node, timer=fresh)
    assert len(fresh.bench.layer_batches) == 1 and alone.seconds == found[0].est_step_time
