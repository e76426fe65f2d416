"""`python -m mpi4dl_nb tune` under mpiexec: the predicted-vs-measured table, the pick (measured,
fitting, fastest), and one-line refusals (no configuration fits, one rank)."""

from __future__ import annotations

import json
import shlex
from collections import Counter

import pytest
import torch

from mpi4dl_nb.cli import train_cmd
from mpi4dl_nb.cli.args import config_from_args
from mpi4dl_nb.comm.waiting import WaitMode
from mpi4dl_nb.measure import trials
from mpi4dl_nb.measure.trials import HELD_TRIALS, Trial, pass_order, release_trials, time_trials, trial_phases
from mpi4dl_nb.planner.fake_world import FakeWorld
from tests.support.checks import RANK_PREFIX
from tests.support.mpirun import run_mpi

TINY = ("--model", "resnet", "--num-layers", "11", "--num-filters", "4", "--image-size", "32",
        "--batch-size", "2", "--top", "2", "--steps", "1")


def _lines(output: str) -> list[str]:
    """The job's output lines without the launcher's rank prefixes (also those before each piece of a long line)."""
    return [RANK_PREFIX.sub("", line) for line in output.splitlines()]


def _errors(output: str) -> list[str]:
    return [line for line in _lines(output) if line.startswith("mpi4dl_nb")]


@pytest.mark.mpi
def test_tune_measures_the_top_configurations_and_picks_a_fitting_one(tmp_path):
    path = tmp_path / "trials.json"
    limit = 500.0
    result = run_mpi(3, "mpi4dl_nb", "tune", *TINY, "--memory-limit-mb", limit, "--save-json", path, "--explain",
                     module=True, timeout=150)
    lines = _lines(result.stdout)
    assert not any("profiler_st" in line for line in lines), result.stdout    # torch profiler's chatter
    header = next(i for i, line in enumerate(lines) if line.startswith("#") and "meas s" in line)
    assert lines[header].split() == ["#", "configuration", "ranks", "pred", "s", "meas", "s", "pred/meas",
                                     "pred", "MB", "meas", "MB", "fits"]
    rows = lines[header + 1:header + 4]
    assert rows[0].startswith("-  one process") and [r.split()[0] for r in rows[1:]] == ["1", "2"], lines
    for row in rows:   # measured: a number in every column, nothing pending
        assert "..." not in row and row.split()[-1] == "yes", row
    picked = next(line for line in lines if line.startswith("picked: "))
    table = json.loads(path.read_text())
    measured = [r for r in table["rows"] if r["config"] is not None]
    assert len(measured) == 2 and all(r["measured_seconds"] is not None for r in measured)
    chosen = next(r for r in measured if r["config"] == table["picked"])   # one of the measured ones
    assert max(chosen["measured_peak_mb"]) <= limit and chosen["fits"]
    assert chosen["measured_seconds"] == min(r["measured_seconds"] for r in measured if r["fits"])
    assert picked.startswith(f"picked: {chosen['label']} ")
    assert any(line.startswith("use: ") and json.dumps(table["picked"]) in line for line in lines)
    command = shlex.split(next(line for line in lines if line.startswith("train with: "))[len("train with: "):])
    assert command[:3] == ["mpiexec", "-n", "3"]             # the pick as train flags, which parse back to it
    back = config_from_args(train_cmd.train_parser().parse_args(command[command.index("train") + 1:])).as_dict()
    layout_only = ("grid", "slice_method")     # a grid the tuner names as rows x cols comes back as its slice method
    assert {k: v for k, v in back.items() if k not in layout_only} == \
        {k: v for k, v in table["picked"].items() if k not in layout_only}
    for row in measured:      # --explain: every rank's predicted and traced phases, which tile its step
        block = lines.index(next(line for line in lines if line.startswith(f"{row['label']}: ")))
        assert [line.split()[0] for line in lines[block + 1:block + 5]] == ["rank", "0", "1", "2"]
        assert lines[block + 5].startswith("largest gap: rank ")
        assert len(row["measured_phases"]) == len(row["predicted_phases"]) == 3
        for traced, predicted in zip(row["measured_phases"], row["predicted_phases"]):
            assert traced["F"] > 0 and traced["B"] > 0 and predicted["F"] > 0
            assert sum(traced.values()) <= max(row["measured_step_seconds"]) + 1e-3   # inside each step


def test_held_rows_step_in_turn_each_pass_in_its_own_order():
    world = FakeWorld(1)
    ctx = world.comm(0, "cpu")
    order = []
    release_trials()
    try:
        with pytest.raises(RuntimeError, match="build_trials first"):
            time_trials(ctx, 1)
        HELD_TRIALS.extend(Trial(lambda name=name: order.append(name), 1) for name in "abc")
        found = time_trials(ctx, 2, first_pass=3)
    finally:
        release_trials()
    assert order[::2] == order[1::2]    # each timed step right after an untimed one of the same row (trials.WARM_STEPS)
    timed = order[1::2]
    passes = [timed[:3], timed[3:]]
    assert all(sorted(steps) == ["a", "b", "c"] for steps in passes)       # one timed step of each row per pass
    assert passes == [["abc"[i] for i in pass_order(3, k)] for k in (3, 4)] and passes[0] != passes[1]
    assert len(found) == 3 and all(len(steps) == 2 for steps in found) and not HELD_TRIALS


class _Meeting:
    """A one-rank context that logs its steps' kinds and the wait mode each barrier waits in."""

    def __init__(self) -> None:
        self.wait_mode = WaitMode.BLOCK
        self.tracer = FakeWorld(1).comm(0, "cpu").tracer
        self.log: list[str] = []

    def barrier(self) -> None:
        self.log.append(str(self.wait_mode))

    def all_gather_object(self, obj):
        self.log.append(f"gather {self.wait_mode}")
        return [obj]


def test_a_rank_idle_in_the_step_before_a_barrier_waits_in_it_asleep():
    """Off rank 0 the one-process row's step does nothing: the barrier after it sleeps (a polling rank beside
    rank 0's torch threads made one process's step 30-70x slower), every other barrier keeps the context's mode."""
    ctx = _Meeting()
    release_trials()
    try:
        HELD_TRIALS.extend([Trial(lambda: ctx.log.append("idle"), None), Trial(lambda: ctx.log.append("busy"), 1)])
        time_trials(ctx, 2)
    finally:
        release_trials()
    barriers = [(before, mode) for before, mode in zip(ctx.log, ctx.log[1:]) if mode in ("block", "yield")]
    assert barriers and all((mode == "yield") == (before == "idle") for before, mode in barriers), ctx.log
    assert ctx.log.count("idle") == 4 and ctx.log[-1] == "gather block" and ctx.wait_mode is WaitMode.BLOCK


def test_each_timed_step_s_action_spans_are_kept_per_row_and_averaged_past_the_warm_pass():
    world = FakeWorld(1)
    ctx = world.comm(0, "cpu")
    ctx.tracer.enabled = True
    steps = Counter()

    def step(name, forward):
        steps[name] += 1
        seconds = 1.0 if steps[name] <= 3 else forward      # the first pass's steps (warm, timed) are slow
        ctx.tracer.record("F", 0.0, seconds)
        ctx.tracer.record("halo", 0.0, 0.1)                # inside F: not an action of its own
        ctx.tracer.record("RECV_GRAD", seconds, seconds + 0.5)

    release_trials()
    try:
        HELD_TRIALS.extend([Trial(lambda: step("a", 0.25), 1), Trial(lambda: step("b", 0.75), 1)])
        time_trials(ctx, 3)
        found = trial_phases(ctx, skip=1)
        everything = trial_phases(ctx)
    finally:
        release_trials()
    assert found == [({"F": 0.25, "RECV_GRAD": 0.5},), ({"F": 0.75, "RECV_GRAD": 0.5},)]
    # the timed steps' spans only (2, 4, 6 of each row: its untimed warm-up steps 1, 3, 5 are not kept)
    assert everything[0][0]["F"] == pytest.approx((1.0 + 0.25 + 0.25) / 3) and not HELD_TRIALS


@pytest.mark.parametrize("rows", range(2, 8))
def test_over_a_cycle_of_passes_every_row_comes_right_after_every_other_equally_often(rows):
    cycle = 2 * rows if rows % 2 else rows
    follows = Counter((before, after) for k in range(cycle)
                      for before, after in zip(pass_order(rows, k), pass_order(rows, k)[1:]))
    assert set(follows) == {(a, b) for a in range(rows) for b in range(rows) if a != b}
    assert len(set(follows.values())) == 1                      # the first row (the reference) too
    assert pass_order(rows, cycle + 1) == pass_order(rows, 1)   # the same order on every rank, from the index


def test_measure_interleaved_releases_the_rows_when_a_round_fails():
    calls = []

    def run(function, *args):
        calls.append(function.__name__)
        if function is trials.build_trials_on_engine:
            return [(1,), (2,)]
        if function is trials.time_trials_on_engine and len(calls) > 2:
            raise RuntimeError("a rank failed")
        return [(0.1,), (0.2,)]

    with pytest.raises(RuntimeError, match="a rank failed"):
        trials.measure_interleaved(run, trials.trial_model(), [None, {"split_size": 2}], 32, 2, steps=1)
    assert calls[-1] == "release_trials_on_engine"
    with pytest.raises(ValueError, match="at least once"):
        trials.measure_interleaved(run, trials.trial_model(), [None], 32, 2, steps=0)


@pytest.mark.mpi
def test_memory_limit_below_every_configuration_exits_with_one_line():
    result = run_mpi(3, "mpi4dl_nb", "tune", *TINY, "--memory-limit-mb", "0.01", module=True,
                     expect_failure=True, timeout=90)
    assert result.returncode != 0 and not result.timed_out
    errors = _errors(result.stdout)
    assert len(errors) == 1 and "no configuration on 3 devices fits" in errors[0], result.stdout
    assert not any("meas s" in line for line in _lines(result.stdout))   # nothing was run


@pytest.mark.mpi
def test_one_rank_is_refused_with_one_line():
    result = run_mpi(1, "mpi4dl_nb", "tune", *TINY, "--memory-limit-mb", "100", module=True,
                     expect_failure=True, timeout=60)
    assert result.returncode == 2 and not result.timed_out
    errors = _errors(result.stdout)
    assert len(errors) == 1 and "at least 2 ranks" in errors[0], result.stdout


@pytest.mark.parametrize("flag, value, says", [("--steps", "0", "must be a number >= 1"),
                                              ("--rounds", "0", "must be a number >= 1"),
                                              ("--headroom", "1.5", "share of the limit")])
def test_bad_measuring_flags_are_refused_before_any_rank_starts(capsys, flag, value, says):
    from mpi4dl_nb.cli.tune_cmd import main

    with pytest.raises(SystemExit) as stop:
        main([*TINY, "--memory-limit-mb", "100", flag, value])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_a_named_model_s_trial_is_built_for_the_image_size_tune_is_given():
    """``tune --image-size 112`` with a timm Swin: the trial's model is built for 112 px, as ``train`` builds it (it
    was built for the card's 224 px and refused: 'SwinTransformer was built for 224x224 images')."""
    from mpi4dl_nb.cli.tune_cmd import tune_job, tune_parser, tuner_of
    from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

    require_or_skip(missing_modules("timm"), "a timm Swin's trial", MODELS_EXTRA)
    job = tune_job(tune_parser().parse_args(["--model", "timm:swin_tiny_patch4_window7_224", "--model-args",
                                             "depths=(1,1,1,1),embed_dim=16,num_heads=(1,1,1,1),window_size=4",
                                             "--image-size", "112", "--memory-limit-mb", "500"]))
    spec = tuner_of(job, 2).spec
    images, _ = spec.batch(112, 1)
    assert torch.nn.Sequential(*spec.build())(images).shape == (1, 2)


@pytest.mark.mpi
def test_tune_measures_a_transformer_with_data_parallel_among_its_candidates():
    swin = ("--model", "timm:swin_tiny_patch4_window7_224", "--model-args",
            "depths=(1,1,1,1),embed_dim=16,num_heads=(1,1,1,1),drop_path_rate=0", "--image-size", "224",
            "--num-classes", "2", "--batch-size", "2", "--top", "2", "--steps", "1", "--rounds", "1")
    result = run_mpi(2, "mpi4dl_nb", "tune", *swin, "--memory-limit-mb", "2000", module=True, timeout=240)
    lines = _lines(result.stdout)
    # data parallelism's all-reduce is one meeting of both holders (the simulated step stalled on it before)
    assert any(line[:1].isdigit() and "1 stage + DP x2" in line and "..." not in line for line in lines), lines
    assert any(line.startswith("picked: ") for line in lines) and not _errors(result.stdout), result.stdout
