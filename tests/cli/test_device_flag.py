"""``--device``/``--backend`` for the train, evaluate and infer commands: cuda (or nccl) on a machine
without a usable GPU exits non-zero at once, naming what is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpi4dl_nb.cli import evaluate_cmd, infer_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.comm import device
from mpi4dl_nb.comm.launcher import rank_environment
from mpi4dl_nb.config import ConfigError
from tests.support.mpirun import REPO
from tests.support.train_in_process import run_command

SMALL = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
         "--image-size", "32", "--batch-size", "2", "--num-samples", "8", "--split-size", "1",
         "--spatial-size", "0", "--steps", "1"]


def parse(*extra: str):
    return cli.train_parser().parse_args(SMALL + list(extra))


def check(*extra: str) -> None:
    """``train``'s check of ``SMALL`` and ``extra`` (ConfigError naming the flag)."""
    cli.train_plan(parse(*extra))


@pytest.mark.parametrize("reason", ["this torch (2.13.0+cpu) was built without CUDA; install ...",
                                    "torch 2.13.0 has CUDA 12.6 but no CUDA device is visible"])
def test_cuda_device_or_nccl_refused_naming_what_is_missing(monkeypatch, reason):
    monkeypatch.setattr(device, "cuda_unavailable_reason", lambda: reason)
    for flags, knob in ((("--device", "cuda"), "--device"), (("--backend", "nccl"), "--backend")):
        with pytest.raises(ConfigError) as error:
            check(*flags)
        assert error.value.knob == knob and reason in str(error.value) and "--device cpu" in str(error.value)
    check("--device", "auto", "--backend", "gloo")     # CPU choices pass


def test_gloo_with_cuda_refused(monkeypatch):
    monkeypatch.setattr(device, "cuda_unavailable_reason", lambda: None)   # as if a GPU were there
    check("--device", "cuda", "--backend", "nccl")
    with pytest.raises(ConfigError, match="gloo moves CPU tensors"):
        check("--device", "cuda", "--backend", "gloo")


@pytest.mark.skipif(device.cuda_unavailable_reason() is None, reason="this machine has a usable GPU")
def test_train_with_cuda_is_refused_before_any_work_here():
    proc = subprocess.run([sys.executable, "-m", "mpi4dl_nb", "train", *SMALL, "--device", "cuda"],
                          capture_output=True, text=True, env=rank_environment(1), cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--device" in proc.stderr and device.cuda_unavailable_reason() in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout.strip(), (proc.stdout, proc.stderr)


def test_context_refuses_cuda_and_mismatched_backends_here():
    from mpi4dl_nb.comm.context import Context

    reason = device.cuda_unavailable_reason()
    if reason is not None:
        with pytest.raises(RuntimeError, match="no CUDA device can be used"):
            Context(device="cuda")
    with pytest.raises(ValueError, match="backend 'nccl' moves CUDA tensors"):
        Context(backend="nccl", device="cpu")


def test_evaluate_and_infer_take_the_same_device_flags():
    """The three commands share one definition: same choices, defaults and check (train's and evaluate's jobs hold
    the one DeviceChoice; every parser offers its choices and default)."""
    from mpi4dl_nb.run.evaluate_job import EvaluateJob
    from mpi4dl_nb.run.job import TrainJob

    assert TrainJob().options.placement == EvaluateJob.of(checkpoint="x").placement == device.DeviceChoice()
    for build in (cli.train_parser, evaluate_cmd.evaluate_parser, infer_cmd.infer_parser):
        shown = " ".join(build().format_help().split())
        assert "--device {auto,cpu,cuda}" in shown and "--backend {auto,mpi,gloo,nccl}" in shown, build
        assert "(default: auto)" in shown


@pytest.mark.skipif(device.cuda_unavailable_reason() is None, reason="this machine has a usable GPU")
@pytest.mark.parametrize("command", [["evaluate", "--checkpoint", "missing.pt"],
                                     ["infer", "--checkpoint", "missing.pt", "--slide", "missing.png",
                                      "--output", "out.npy"]])
def test_evaluate_and_infer_with_cuda_are_refused_before_any_work_here(command, tmp_path, monkeypatch, capsys):
    """The commands' dispatch in this process (train's test above runs ``python -m mpi4dl_nb`` as its own process;
    two more interpreters cost ~20 s of the suite on two cores). Not ``__main__.main``: its watched end
    (run/teardown.py) would stay armed in the test process for the tests after this one."""
    from mpi4dl_nb.cli.commands import main

    monkeypatch.chdir(tmp_path)
    code, out, err = run_command(main, [*command, "--device", "cuda"], capsys)
    assert code == 2, (out, err)
    assert "--device" in err and device.cuda_unavailable_reason() in err, err
    assert "Traceback" not in err and not out.strip(), (out, err)
