"""evaluation/progress.py and HeldOutBatches.each_batch: the held-out evaluation's progress line (batches, images
that count, speed, time left), paced outside a terminal, ended when the batches end early, silent on other ranks."""
from __future__ import annotations

import io

import pytest

from mpi4dl_nb.evaluation.evaluator import HeldOutBatches
from mpi4dl_nb.evaluation.progress import HeldOutProgress, held_out_text


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_the_line_counts_only_real_images_and_ends_with_the_time_left():
    assert held_out_text(3, 10, 24, 80, 12.5, 14) == "evaluate batch 3/10 images 24/80 12.50 img/s ETA 0:14"
    out, clock = io.StringIO(), Clock()
    progress = HeldOutProgress(3, 4, 10, True, out, every=0.0, clock=clock)
    for batch in (1, 2, 3):
        clock.now += 2.0                       # 2 s a batch of 4: the last batch holds 2 real images and 2 repeats
        progress.batch_done(batch)
    assert [line.split("] ")[1] for line in out.getvalue().splitlines()] == [
        "evaluate batch 1/3 images 4/10 2.00 img/s ETA 0:04",
        "evaluate batch 2/3 images 8/10 2.00 img/s ETA 0:02",
        "evaluate batch 3/3 images 10/10 1.67 img/s ETA 0:00"]


def test_outside_a_terminal_one_line_every_few_seconds_and_the_last():
    out, clock = io.StringIO(), Clock()
    progress = HeldOutProgress(6, 2, 12, True, out, every=5.0, clock=clock)
    for batch in range(1, 7):
        clock.now += 2.0                       # batches 1, 4 (6 s after 1) and the last are shown
        progress.batch_done(batch)
    assert [line.split(" images")[0].split("] ")[1] for line in out.getvalue().splitlines()] == [
        "evaluate batch 1/6", "evaluate batch 4/6", "evaluate batch 6/6"]


class Batches(HeldOutBatches):
    """HeldOutBatches' batch loop alone: 5 images in batches of 2 (no engine, no reads)."""

    def __init__(self) -> None:
        self.dataset = [0] * 5        # type: ignore[assignment]
        self.batch_size = 2
        self.progress = None


def test_each_batch_reports_after_its_body_and_ends_the_line_when_stopped_early():
    batches = Batches()
    assert list(batches.each_batch()) == [0, 1, 2]          # no progress asked: the batches alone
    out = io.StringIO()
    batches.progress = HeldOutProgress(batches.batches, 2, 5, True, out, every=60.0)
    seen = []
    with pytest.raises(RuntimeError):
        for batch in batches.each_batch():
            seen.append(out.getvalue().count("\n"))        # lines written before this batch's body
            if batch == 2:
                raise RuntimeError("a rank failed")
    lines = out.getvalue().splitlines()
    assert seen == [0, 1, 1]       # batch 1's line written at once; batch 2's held back (paced) ...
    assert [line.split(" images")[0].split("] ")[1] for line in lines] == [
        "evaluate batch 1/3", "evaluate batch 2/3"]                     # ... and written when the loop ended


def test_other_ranks_print_nothing():
    out = io.StringIO()
    progress = HeldOutProgress(2, 2, 4, False, out)
    progress.batch_done(1)
    progress.finish()
    assert out.getvalue() == ""
