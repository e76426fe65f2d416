"""Progress on every command (issue 81, item 10): a line as each part of the set-up starts (rank 0), infer's lines with
the rate and the time left, and ``--no-progress`` on every command that prints progress, silencing both."""
from __future__ import annotations

import contextlib
import io
import re

import pytest

from mpi4dl_nb.cli.commands import COMMANDS
from mpi4dl_nb.console import SetupLines
from mpi4dl_nb.infer.pace import PacedProgress, slides_text

TRAIN = ["--model", "resnet", "--num-layers", "8", "--num-filters", "4", "--image-size", "32", "--num-classes", "2",
         "--batch-size", "2", "--num-samples", "4", "--steps", "2", "--split-size", "1", "--spatial-size", "0",
         "--app", "synthetic"]


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_every_command_that_prints_progress_takes_no_progress():
    """train, evaluate and infer print progress, and each parser takes --no-progress (its value: no progress)."""
    takes = {command.name for command in COMMANDS
             if "--no-progress" in command.parser()._option_string_actions}
    assert {"train", "evaluate", "infer"} <= takes


def test_infer_lines_end_with_the_rate_and_the_time_left():
    """The rate is the amount per second since the line was made; the time left, the time per part so far (after the
    parts done before) times the parts left."""
    out, clock = io.StringIO(), Clock()
    line = PacedProgress(4, True, out, first=1, clock=clock)
    clock.now += 2.0
    line.update(2, "windows 2/4", 5.0, "MP")         # 1 part in 2 s, 2 left
    clock.now += 2.0
    line.update(4, "windows 4/4", 12.0, "MP")
    assert out.getvalue().splitlines() == ["[###############...............] windows 2/4 2.50 MP/s ETA 0:04",
                                           "[##############################] windows 4/4 3.00 MP/s ETA 0:00"]
    silent = io.StringIO()
    PacedProgress(4, False, silent, clock=clock).update(1, "windows 1/4", 1.0, "MP")
    assert silent.getvalue() == ""
    assert slides_text(2, 5, 30.0) == "2/5 slides, 30 s, 0.07 slides/s ETA 0:45"


def test_set_up_lines_are_said_only_when_enabled(capsys):
    SetupLines("infer", True).doing("opening the slide s.svs")
    SetupLines("infer", True).note("--map-mode auto: dense for resnet")
    SetupLines("infer", False).doing("planning the windows")
    assert capsys.readouterr().err.splitlines() == ["mpi4dl_nb infer: setting up: opening the slide s.svs ...",
                                                    "mpi4dl_nb infer: --map-mode auto: dense for resnet"]


@pytest.mark.parametrize("quiet", [False, True])
def test_train_says_its_set_up_before_the_first_step(capsys, quiet):
    """``train``: the model, the data and the engine said as they start, then a step line with rate and time left;
    --no-progress: neither (the JSON summary alone, on stdout)."""
    from mpi4dl_nb.cli.train_cmd import main as train_main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert train_main([*TRAIN, *(["--no-progress"] if quiet else [])]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert out.getvalue().count("\n") == 1
    if quiet:
        assert lines == []
        return
    assert lines[:3] == ["mpi4dl_nb train: setting up: building the model (resnet) ...",
                         "mpi4dl_nb train: setting up: opening the synthetic data (no --datapath) ...",
                         "mpi4dl_nb train: setting up: building the engine on 1 rank ..."], lines
    step = r"\[[#.]{30}\] step \d/2 loss \d+\.\d{4} \d+\.\d\d img/s ETA \d+:\d\d"
    assert lines[3:] and all(re.fullmatch(step, text) for text in lines[3:]), lines


@pytest.mark.parametrize("quiet", [False, True])
def test_evaluate_says_its_set_up_before_it_reads_images(capsys, tmp_path, quiet):
    """``evaluate``: the checkpoint, the data and the model's placement said as they start, before the progress bar;
    --no-progress: nothing on stderr (the JSON summary alone, on stdout)."""
    from mpi4dl_nb.cli.evaluate_cmd import main as evaluate_main
    from mpi4dl_nb.cli.train_cmd import main as train_main

    with contextlib.redirect_stdout(io.StringIO()):
        assert train_main([*TRAIN, "--no-progress", "--checkpoint-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert evaluate_main(["--checkpoint", str(tmp_path), "--split-size", "1", "--spatial-size", "0",
                              *(["--no-progress"] if quiet else [])]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert out.getvalue().count("\n") == 1
    if quiet:
        assert lines == []
        return
    assert lines[0].startswith(f"mpi4dl_nb evaluate: setting up: reading the checkpoint's record {tmp_path}"), lines
    assert lines[1] == "mpi4dl_nb evaluate: setting up: opening the synthetic data (no --datapath) ...", lines
    assert lines[2].startswith(f"mpi4dl_nb evaluate: setting up: loading the checkpoint's model {tmp_path}/step-")
    assert lines[3] == "mpi4dl_nb evaluate: setting up: placing the model on 1 rank ...", lines
