"""The front door: the ``mpi4dl-nb`` console script and ``python -m mpi4dl_nb`` are one entry (``__main__.main``),
the same under ``mpiexec``, and a pipe closed by its reader ends them quietly."""
from __future__ import annotations

import functools
import os
import runpy
import signal
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import mpi4dl_nb.__main__ as entry
import mpi4dl_nb.cli.commands as commands
import mpi4dl_nb.run.teardown as teardown
from mpi4dl_nb.comm.launcher import Launcher, rank_environment
from tests.support.mpirun import run_mpi
from tests.support.summary import json_record

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "mpi4dl-nb"      # written by ``pip install -e .`` from [project.scripts]
MODULE = [sys.executable, "-m", "mpi4dl_nb"]
ENTRY = "mpi4dl_nb.__main__:main"
# 2 layer stages of a small float64 ResNet on synthetic images, 2 steps: a few seconds
TINY = ["train", "--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
        "--image-size", "32", "--batch-size", "2", "--num-samples", "4", "--steps", "2", "--dtype", "float64",
        "--split-size", "2", "--spatial-size", "0", "--no-progress"]
TIMING = ("images_per_s", "wall_seconds", "compute_seconds", "comm_seconds", "input_wait_seconds", "train_seconds",
          "run_id")


def test_console_script_is_the_entry_of_python_dash_m():
    scripts = (REPO / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n[")[0]
    assert [line.split("#")[0].strip() for line in scripts.splitlines() if line.strip()] == [f'mpi4dl-nb = "{ENTRY}"']
    (installed,) = entry_points(group="console_scripts", name="mpi4dl-nb")
    assert installed.value == ENTRY, "re-install the package (pip install -e .): its console script is stale"
    assert installed.load() is entry.main
    assert "from mpi4dl_nb.__main__ import main" in SCRIPT.read_text()


def test_both_run_the_command_through_the_watched_teardown(monkeypatch):
    """``python -m`` runs ``__main__.main``, which hands the command table's ``main`` to ``exit_watched``."""
    calls: list[tuple[functools.partial, list[str]]] = []

    def watched(command, argv):
        calls.append((command, list(argv)))
        return 0
    monkeypatch.setattr(teardown, "exit_watched", watched)     # what ``python -m`` imports afresh
    monkeypatch.setattr(entry, "exit_watched", watched)        # what the console script's ``main`` calls
    monkeypatch.setattr(sys, "argv", ["mpi4dl-nb", "layout", "--split-size", "2"])
    monkeypatch.delitem(sys.modules, "mpi4dl_nb.__main__")    # run it as ``python -m`` does, not as imported
    with pytest.raises(SystemExit) as stop:
        runpy.run_module("mpi4dl_nb", run_name="__main__")
    assert stop.value.code == 0
    assert entry.main() == 0
    argv = ["layout", "--split-size", "2"]
    assert [(c.func, list(c.args), a) for c, a in calls] == [(commands.main, [argv], argv)] * 2


@pytest.mark.parametrize(("argv", "codes"), [([str(SCRIPT), "--help"], {entry.BROKEN_PIPE_EXIT}),
                                             ([*MODULE, "--help"], {entry.BROKEN_PIPE_EXIT}),
                                             ([str(SCRIPT), "layout", "--help"], {0, entry.BROKEN_PIPE_EXIT})],
                         ids=["script", "module", "script-layout"])
def test_a_pipe_closed_by_its_reader_ends_quietly(argv, codes):
    """``mpi4dl-nb --help | head -1``, with the reader gone before the first write: no traceback, exit code 141
    (argparse's own help drops the failed write and exits 0)."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO)
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode in codes


def test_a_pipe_into_head_prints_no_traceback():
    done = subprocess.run(f"'{SCRIPT}' --help | head -1", shell=True, capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("usage: ") and done.stdout.count("\n") == 1
    assert done.stderr == ""


def summary(argv: list[str]) -> dict:
    """The JSON summary of 2 ranks of ``argv`` under a real ``mpiexec``, timings and the run id left out."""
    proc = subprocess.Popen(Launcher.find().command(2, argv), env=rank_environment(2), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == 0, out
    record = json_record(out)
    return {key: value for key, value in record.items() if key not in TIMING}


@pytest.mark.mpi
def test_console_script_and_python_dash_m_train_alike_under_mpiexec():
    by_script, by_module = summary([str(SCRIPT), *TINY]), summary([*MODULE, *TINY])
    assert by_script["steps_run"] == 2 and by_script["world_size"] == 2
    assert by_script == by_module


@pytest.mark.mpi
def test_an_error_on_one_rank_aborts_the_world_instead_of_leaving_the_others_waiting():
    result = run_mpi(2, "entry_abort", expect_failure=True, timeout=60)
    assert not result.timed_out and result.returncode != 0
    assert "RuntimeError: an error on rank 0 that no command turned into a message" in result.stdout


@pytest.mark.mpi
def test_a_configuration_error_after_mpi_started_is_one_line_and_ends_the_world():
    result = run_mpi(2, "entry_abort", "config", expect_failure=True, timeout=60)
    assert not result.timed_out and result.returncode == 2, result.stdout
    assert "mpi4dl_nb: configuration error: --backend" in result.stdout and "use --backend mpi" in result.stdout
    assert "Traceback" not in result.stdout
