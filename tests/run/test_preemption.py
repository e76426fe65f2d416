"""Pre-emption (run/preemption.py): a stop signal ends training after the step in flight with a checkpoint and exit
code 7 on every rank, also one the signal missed; ``--resume latest`` then continues exactly (float64)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mpi4dl_nb.checkpoint import files as ck
from mpi4dl_nb.evaluation.log import RecordKind, read_metrics, tensorboard_scalars
from mpi4dl_nb.run.preemption import EXIT_PREEMPTED, Preempted, StopSignals
from tests.support.mpirun import run_mpi, start_mpi
from tests.support.summary import json_record
from tests.support.train_in_process import run_train

MODEL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", "--batch-size", "4", "--num-samples", "16", "--dtype", "float64",
         "--lr", "0.05", "--momentum", "0.9", "--no-progress"]
SERIAL = ["--split-size", "1", "--spatial-size", "0"]
TWO_STAGES = ["--split-size", "2", "--spatial-size", "0"]      # 2 ranks: a layer stage each, as one process computes
STEPS = 16


class OtherRank:
    """A stand-in world of two ranks for ``StopSignals.agreed_signal``: the other rank heard ``heard`` (a signal or
    None)."""

    def __init__(self, heard: signal.Signals | None) -> None:
        self.heard = heard

    def all_gather_object(self, obj: object) -> list[object]:
        return [obj, None if self.heard is None else int(self.heard)]


@pytest.fixture
def usr1_kept():
    """A SIGUSR1 handler of the test's own (a signal arriving late must not end pytest); the calls it got."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: calls.append(number))
    yield calls
    signal.signal(signal.SIGUSR1, previous)


def test_a_signal_only_marks_the_stop_and_the_previous_handler_comes_back(usr1_kept):
    own, term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert stop.installed and signal.getsignal(signal.SIGUSR1) != own
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)          # a second signal changes nothing
        time.sleep(0.01)
    assert stop.received is signal.SIGUSR1 and not stop.installed
    assert signal.getsignal(signal.SIGUSR1) == own and signal.getsignal(signal.SIGTERM) == term
    assert usr1_kept == []                              # the test's handler saw nothing meanwhile


def test_a_stop_marked_earlier_counts_and_a_stopping_restore_ignores_repeats(usr1_kept):
    term = signal.getsignal(signal.SIGTERM)
    try:
        early = StopSignals().install()                 # the command's, from its start: set-up
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        with StopSignals() as stop:                     # the trainer's, installed after the signal came
            assert stop.received is signal.SIGTERM
        early.restore(stopping=True)
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)            # a repeat in the teardown: ignored, the test goes on
        time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, term)
    assert usr1_kept == []


def test_a_thread_installs_nothing():
    term = signal.getsignal(signal.SIGTERM)
    seen: list[bool] = []
    worker = threading.Thread(target=lambda: seen.append(StopSignals().install().installed))
    worker.start()
    worker.join()
    assert seen == [False] and signal.getsignal(signal.SIGTERM) == term


def test_a_rank_the_signal_missed_stops_with_the_others():
    missed = StopSignals()                              # this rank heard nothing
    assert missed.agreed_signal(OtherRank(None)) is None
    assert missed.agreed_signal(OtherRank(signal.SIGUSR1)) is signal.SIGUSR1
    heard = StopSignals()
    heard.received = signal.SIGUSR1
    # several: the first of STOP_SIGNALS, everywhere
    assert heard.agreed_signal(OtherRank(signal.SIGTERM)) is signal.SIGTERM


def test_the_message_names_the_signal_step_and_checkpoint():
    saved = Preempted(signal.SIGTERM, 17, Path("ck/step-00000017-abc.pt")).message()
    assert saved == ("pre-empted (SIGTERM) after step 17: checkpoint ck/step-00000017-abc.pt; resume with "
                     "--resume latest")
    assert "no checkpoint could be written (no --checkpoint-dir)" in Preempted(signal.SIGUSR1, 3, None).message()


def signal_at_step(log_dir: Path, step: int, send: Callable[[], object], deadline: float = 120) -> threading.Thread:
    """A thread that calls ``send()`` once the metrics log of ``log_dir`` records ``step``."""
    def watch() -> None:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if (log_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in read_metrics(log_dir)):
                send()
                return
            time.sleep(0.01)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_without_a_checkpoint_dir_it_says_so_and_exits_7_and_the_log_has_the_step_figures(tmp_path, capsys,
                                                                                           usr1_kept):
    """One process, SIGUSR1 after step 1: the run ends early with exit code 7 and says no checkpoint could be written;
    the metrics log's steps carry the learning rate, images/s and seconds per step, as TensorBoard scalars too."""
    term = signal.getsignal(signal.SIGTERM)
    watcher = signal_at_step(tmp_path, 1, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    try:
        code, out, err = run_train([*SERIAL, *MODEL, "--steps", "200", "--log-dir", str(tmp_path)], capsys)
        # pre-empted: the stop signals are ignored from then on (a repeat in the teardown ends no rank)
        assert signal.getsignal(signal.SIGUSR1) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, term)
    watcher.join()
    record = json_record(out)
    assert code == EXIT_PREEMPTED and record["preempted"] == "SIGUSR1" and 1 <= record["steps"] < 200, err
    assert f"mpi4dl_nb train: pre-empted (SIGUSR1) after step {record['steps']}: no checkpoint could be written" in err
    assert usr1_kept == []
    steps = [r for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, record["steps"] + 1))
    last = steps[-1]
    assert last["lr"] == 0.05 and last["images_per_s"] > 0 and last["seconds"] > 0
    assert set(tensorboard_scalars(RecordKind.TRAIN, last)) == {
        "train/loss", "train/lr", "train/images_per_s", "train/seconds_per_step"}


@pytest.mark.mpi
def test_sigterm_to_mpiexec_checkpoints_exits_7_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path, capsys):
    """Acceptance: SIGTERM to ``mpiexec`` of a 2-rank float64 run (forwarded to both ranks) at step >= 2: the step in
    flight finishes, a checkpoint of it, exit code 7; ``--resume latest`` to the end gives one process's losses."""
    folder, logs = tmp_path / "ck", tmp_path / "logs"
    common = [*MODEL, *TWO_STAGES, "--steps", str(STEPS), "--checkpoint-dir", str(folder)]
    job = start_mpi(2, "mpi4dl_nb", "train", *common, "--log-dir", logs, module=True, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True)
    sent: list[float] = []
    try:
        signal_at_step(logs, 2, lambda: (job.send_signal(signal.SIGTERM), sent.append(time.monotonic())))
        out, _ = job.communicate(timeout=180)
        ended = time.monotonic()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    stopped = json_record(out)
    step = stopped["steps"]
    assert job.returncode == EXIT_PREEMPTED and stopped["preempted"] == "SIGTERM" and 2 <= step < STEPS, out
    latest = ck.latest_checkpoint(folder)
    assert ck.load_checkpoint(latest)["step"] == step and stopped["checkpoint"] == str(latest)
    assert f"pre-empted (SIGTERM) after step {step}: checkpoint {latest}; resume with --resume latest" in out
    with capsys.disabled():
        print(f"\n[batch-jobs table] SIGTERM to mpiexec (2 ranks): job ended {ended - sent[0]:.1f} s after the signal, "
              f"at step {step}, exit code {job.returncode}")
    resumed = json_record(run_mpi(2, "mpi4dl_nb", "train", *common, "--resume", "latest", module=True,
                                  timeout=180).stdout)
    assert resumed["start_step"] == step and resumed["steps"] == STEPS and "preempted" not in resumed
    code, straight, err = run_train([*SERIAL, *MODEL, "--steps", str(STEPS)], capsys)
    assert code == 0, err
    uninterrupted = json_record(straight)["losses"]
    interrupted = stopped["losses"] + resumed["losses"]
    assert len(interrupted) == STEPS and max(abs(a - b) for a, b in zip(interrupted, uninterrupted)) < 1e-12


def repeated_sigterm(job: subprocess.Popen[str], every: float = 0.01) -> None:
    """SIGTERM to ``job`` every ``every`` seconds until it ends (``scancel`` repeated, a node shutting down)."""
    while job.poll() is None:
        try:
            job.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        time.sleep(every)


@pytest.mark.mpi
def test_sigterm_every_10_ms_to_mpiexec_still_exits_7_with_the_checkpoint(tmp_path):
    """Signals that keep coming (from step 2 until the job ends): the first stops the run after its step and a
    checkpoint; the later ones are marked or ignored through the teardown, so every rank ends with exit status 7 and
    the requeue test of docs/batch-jobs.md (``[ $code -eq 7 ]``) holds."""
    folder, logs = tmp_path / "ck", tmp_path / "logs"
    job = start_mpi(2, "mpi4dl_nb", "train", *MODEL, *TWO_STAGES, "--steps", str(STEPS), "--checkpoint-dir", folder,
                    "--log-dir", logs, module=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        signal_at_step(logs, 2, lambda: repeated_sigterm(job))
        out, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    stopped = json_record(out)
    assert job.returncode == EXIT_PREEMPTED and stopped["preempted"] == "SIGTERM", out
    latest = ck.latest_checkpoint(folder)
    assert ck.load_checkpoint(latest)["step"] == stopped["steps"] and stopped["checkpoint"] == str(latest)
