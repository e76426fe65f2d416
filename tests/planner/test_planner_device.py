"""The planner predicts for the job's device: every layer timing and copy-speed measurement of
``tune``, ``suggest`` and the one-knob sweep is made on the device the job runs on (a recording
stand-in for ``cuda:0`` here), and the crowded-core model - its calibration rounds and its terms -
enters only on a CPU job whose ranks outnumber the cores."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

from mpi4dl_nb import ParallelConfig, planner
from mpi4dl_nb.comm import waiting
from mpi4dl_nb.measure import calibration, trials
from mpi4dl_nb.measure.calibration import CrowdedRounds, calibrate_job
from mpi4dl_nb.planner.crowding import NO_CROWDING, Crowding, crowds
from mpi4dl_nb.planner.layer_timer import TorchDevice, measuring_device
from mpi4dl_nb.planner.step_time import step_model
from mpi4dl_nb.planner.tune import Tuner
from tests.planner.recording import RecordingDevice

PAIR, CROWD = 1e-4, 5e-4     # seconds a meeting of two ranks, of all ranks, costs in the canned rounds


class FakeJob:
    """Stands in for a job's communicator in ``calibrate_job``: its device and ranks, one voice."""

    def __init__(self, device: str, world_size: int) -> None:
        self.device, self.world_size, self.rank = torch.device(device), world_size, 0

    def bcast_object(self, obj, root=0):
        return obj


@pytest.fixture
def rounds(monkeypatch):
    """``calibrate_job``'s rounds replaced by recorders with canned results, on a 2-core node:
    the list of (round, device) run."""
    ran = []

    def recorder(name, result):
        def run(ctx, *args, **kwargs):
            which = name if name != "meeting" else ("pair meeting" if kwargs.get("ranks") else "crowd meeting")
            ran.append((which, str(ctx.device)))
            return result(kwargs) if callable(result) else result
        return run

    monkeypatch.setattr(calibration, "ping_pong", recorder("ping_pong", [(1024, 1e-5), (1 << 20, 1e-3)]))
    monkeypatch.setattr(calibration, "meeting_cost", recorder("meeting", lambda kw: PAIR if kw.get("ranks") else CROWD))
    monkeypatch.setattr(calibration, "waiting_slowdown", recorder("waiting_slowdown", 1.5))
    monkeypatch.setattr(calibration, "handoff_seconds", recorder("handoff", 2e-4))
    monkeypatch.setattr(waiting, "node_cores", lambda: 2)
    return ran


CROWDED_ROUNDS = {"crowd meeting", "waiting_slowdown"}


@pytest.fixture(autouse=True)
def no_real_device(monkeypatch):
    """Nothing here is measured on this machine's real device: only through the recorders."""
    def refuse(self, *args):
        raise AssertionError(f"measured on the real {self.device}, not the job's (recorded) device")
    monkeypatch.setattr(TorchDevice, "time_layers", refuse)
    monkeypatch.setattr(TorchDevice, "copy_bandwidth", refuse)


def test_calibration_runs_the_crowded_rounds_only_when_ranks_outnumber_a_cpu_node_s_cores(rounds):
    gpu = calibrate_job(FakeJob("cuda:0", 4))
    assert [name for name, _ in rounds] == ["ping_pong", "pair meeting", "handoff"]
    assert gpu.device == "cuda:0" and gpu.crowded is None and gpu.pair_seconds == PAIR
    assert planner.network_of(gpu).crowding == NO_CROWDING and planner.network_of(gpu).meeting == PAIR
    rounds.clear()
    assert calibrate_job(FakeJob("cpu", 2)).crowded is None and not CROWDED_ROUNDS & {n for n, _ in rounds}
    rounds.clear()
    cpu = calibrate_job(FakeJob("cpu", 5))       # 5 ranks on 2 cores
    assert [name for name, _ in rounds] == ["ping_pong", "pair meeting", "crowd meeting", "crowd meeting",
                                            "waiting_slowdown", "handoff"]
    assert cpu.crowded == CrowdedRounds(CROWD, CROWD, 1.5) and cpu.device == "cpu"
    crowding = planner.network_of(cpu).crowding
    assert crowding.sync == pytest.approx(CROWD - PAIR) and crowding.waiting_slowdown == 1.5
    assert crowding.crowd_members == 5


def fake_ranks(job: FakeJob, peak: int, calls: list):
    """Stands in for the ranks of ``job`` in a Tuner: calibration through ``calibrate_job``,
    every configuration built at ``peak`` bytes and timed at 0.1 s a step."""
    built = []

    def run(function, *args):
        calls.append(function)
        if function is trials.calibrate_job_on_engine:
            return calibrate_job(job)
        if function is trials.device_on_engine:
            return str(job.device)
        if function is trials.build_trials_on_engine:
            built[:] = args[1]
            return [(peak,) * job.world_size for _ in built]
        if function is trials.time_trials_on_engine:
            return [(0.1,) * args[0] for _ in built]
        if function is trials.trial_phases_on_engine:
            return [tuple({} for _ in range(job.world_size)) for _ in built]
        return None
    return run


@pytest.fixture(scope="module")
def spec():
    return trials.ModelSpec("resnet", 11, 8)


def test_tune_and_its_sweep_on_a_cuda_job_measure_on_cuda_0_and_run_no_crowded_round(rounds, spec):
    one = planner.estimate_memory(spec.build(), ParallelConfig(split_size=1, spatial_size=0), 32, 2).peak
    devices: dict[str, RecordingDevice] = {}

    def measure_on(name: str) -> RecordingDevice:
        return devices.setdefault(name, RecordingDevice(name))

    calls: list = []
    tuner = Tuner(spec, 32, 2, 0.9 * one, 3, fake_ranks(FakeJob("cuda:0", 3), int(0.5 * one), calls), top=2,
                  steps=1, measure_on=measure_on)
    result = tuner()
    assert tuner.device == "cuda:0" and result.best is not None
    copies = [what for what, _, _ in devices["cuda:0"].measurements].count("copy")
    # the best may be zb1 (parts >= split_size): sweep its 1F1B twin, whose parts 1 and 2 both run
    sweep = tuner.sweep(replace(result.best.cfg, schedule="1f1b"), result.network, knobs=("parts",))
    assert len(sweep.rows) > 2
    assert list(devices) == ["cuda:0"]
    measured = devices["cuda:0"].measurements
    assert [what for what, _, _ in measured].count("copy") == copies + 1      # the sweep's own, on the job's device
    assert {what for what, _, _ in measured} == {"layers", "copy"}
    assert {device for _, device, _ in measured} == {"cuda:0"}        # every layer timing and copy speed
    assert rounds and not CROWDED_ROUNDS & {name for name, _ in rounds}
    assert result.network.crowding == NO_CROWDING
    assert all(timeline.compute > 0 for row in result.candidates for timeline in row.plan.ranks)


def test_a_tuner_not_calibrated_asks_the_ranks_their_device(spec):
    one = planner.estimate_memory(spec.build(), ParallelConfig(split_size=1, spatial_size=0), 32, 2).peak
    recorder = RecordingDevice("cuda:0")
    calls: list = []
    tuner = Tuner(spec, 32, 2, 0.9 * one, 3, fake_ranks(FakeJob("cuda:0", 3), int(0.5 * one), calls), top=2,
                  measure_on=lambda name: recorder if name == "cuda:0" else RecordingDevice(name))
    tuner.plan(planner.Network())
    assert calls == [trials.device_on_engine] and tuner.device == "cuda:0"
    assert recorder.layer_batches and {device for _, device, _ in recorder.measurements} == {"cuda:0"}


def test_offline_suggest_measures_on_the_device_it_is_given(spec):
    layers = spec.build()
    one = planner.estimate_memory(layers, ParallelConfig(split_size=1, spatial_size=0), 32, 2).peak
    gpu = RecordingDevice("cuda:0")
    found = planner.suggest(layers, 32, 0.9 * one, 3, batch_size=2, device=gpu, top=None)
    assert len(found) > 1 and gpu.layer_batches == [sum(gpu.layer_batches)]    # one measurement
    assert [what for what, _, _ in gpu.measurements].count("copy") == 1
    assert {device for _, device, _ in gpu.measurements} == {"cuda:0"}
    assert measuring_device("cuda:0") == TorchDevice(torch.device("cuda:0"))
    assert measuring_device("cuda:0").cores() is None and measuring_device("cpu").cores() >= 1
    assert measuring_device(gpu) is gpu


def test_crowded_core_terms_enter_only_when_ranks_outnumber_a_cpu_node_s_cores(spec):
    layers = spec.build()
    crowded = planner.Network(1e-5, 1e9, meeting=1e-4, crowding=Crowding(sync=1e-3, waiting_slowdown=1.5))
    plain = dataclasses.replace(crowded, crowding=NO_CROWDING)

    def seconds(cfg, device, network):
        return step_model(layers, cfg, 32, 2, device=device, network=network).predict().seconds

    spatial = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4)      # 5 ranks
    cpu, gpu = RecordingDevice("cpu", cpu_cores=2), RecordingDevice("cuda:0")
    assert crowds(2, 5) and not crowds(2, 2) and not crowds(None, 5)
    assert seconds(spatial, cpu, crowded) > seconds(spatial, cpu, plain) * 1.05
    assert seconds(spatial, gpu, crowded) == seconds(spatial, gpu, plain)          # a GPU per rank
    roomy = RecordingDevice("cpu", cpu_cores=8)                                       # a core per rank
    assert seconds(spatial, roomy, crowded) == seconds(spatial, roomy, plain)
    pair = ParallelConfig(split_size=2, spatial_size=0, parts=2)                      # 2 ranks on 2 cores
    assert seconds(pair, cpu, crowded) == seconds(pair, cpu, plain)
