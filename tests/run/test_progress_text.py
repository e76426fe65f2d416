"""run/train_progress.py: the training progress line (step, loss, speed, accuracy, time left) after the bar; outside a
terminal the first and last step and one line every few seconds; a run stopping early shows its last step."""
from __future__ import annotations

import io

from mpi4dl_nb.run.train_progress import TrainProgress, clock_text, progress_text


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_line_ends_with_the_time_left():
    assert progress_text(4, 4, 1.25, 3.5, 0.75, 0) == "step 4/4 loss 1.2500 3.50 img/s val_acc 0.750 ETA 0:00"
    assert [clock_text(s) for s in (7.4, 754, 3723)] == ["0:07", "12:34", "1:02:03"]


def test_outside_a_terminal_one_line_every_few_seconds_and_the_last():
    out, clock = io.StringIO(), Clock()
    progress = TrainProgress(10, True, out, first_step=2, every=5.0, clock=clock)
    for step, seconds in ((3, 2.0), (4, 2.0), (5, 2.0), (6, 2.0), (10, 2.0)):
        clock.now += seconds                   # 2 s a step: steps 3, 6 (5 s after 3) and the last are shown
        progress.step(step, 1.0, 2.0, None)
    assert out.getvalue().splitlines() == [
        "[#########.....................] step 3/10 loss 1.0000 2.00 img/s ETA 0:14",    # 2 s for 1 step, 7 left
        "[##################............] step 6/10 loss 1.0000 2.00 img/s ETA 0:08",
        "[##############################] step 10/10 loss 1.0000 2.00 img/s ETA 0:00"]


def test_a_run_stopping_early_shows_its_last_step():
    out, clock = io.StringIO(), Clock()
    progress = TrainProgress(10, True, out, every=5.0, clock=clock)
    for step in (1, 2):
        clock.now += 1.0
        progress.step(step, 1.0, 2.0, None)
    progress.finish()
    assert [line.split(" loss")[0] for line in out.getvalue().splitlines()] == [
        "[###...........................] step 1/10", "[######........................] step 2/10"]
    progress.finish()                          # nothing held back: nothing more
    assert len(out.getvalue().splitlines()) == 2


def test_on_a_terminal_every_step_is_redrawn_and_an_early_end_ends_the_line():
    out, clock = Terminal(), Clock()
    progress = TrainProgress(4, True, out, every=5.0, clock=clock)
    for step in (1, 2):
        clock.now += 1.0
        progress.step(step, 1.0, 2.0, None)
    progress.finish()
    assert out.getvalue().count("\r") == 2 and out.getvalue().endswith("ETA 0:02\n")


def test_other_ranks_print_nothing():
    out = io.StringIO()
    progress = TrainProgress(2, False, out)
    progress.step(1, 1.0, 2.0, None)
    progress.finish()
    assert out.getvalue() == ""
