"""A GPU node faked on CPU: the data plane ``auto`` picks when ranks share a GPU, ``nccl`` refused there, and the
rank's GPU made current before MPI starts (the CLI's entry, ``Context``, a notebook engine)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from mpi4dl_nb.comm.context import Context
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.notebook.cluster import Cluster
from tests.support.mpirun import REPO


class _Node:
    """An MPI world stand-in: this process is rank 0 of 2 ranks on one node; ``nodes`` is (local ranks, GPUs) of
    every rank as ``allgather`` would return it."""

    def __init__(self, nodes: list[tuple[int, int]]) -> None:
        self.nodes = nodes

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 2

    def Split_type(self, kind: int, key: int) -> _Node:
        return self

    def Free(self) -> None:
        return None

    def allgather(self, value: tuple[int, int]) -> list[tuple[int, int]]:
        return self.nodes


class _PlaneStarted(Exception):
    """Raised where the Context would start the data plane it chose."""


@pytest.fixture()
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node with 1 GPU: the context places on ``cuda:0``; no plane starts (``_PlaneStarted`` names the one chosen)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    def start(self: Context, backend: str) -> None:
        raise _PlaneStarted(backend)
    monkeypatch.setattr(Context, "_start_plane", start)


def _chosen(backend: str, nodes: list[tuple[int, int]]) -> str:
    with pytest.raises(_PlaneStarted) as started:
        Context(backend=backend, device=torch.device("cuda", 0), comm=_Node(nodes))  # type: ignore[arg-type]
    return str(started.value)


@pytest.mark.usefixtures("one_gpu")
def test_auto_takes_the_mpi_plane_when_two_ranks_share_one_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert _chosen("auto", [(2, 1), (2, 1)]) == "mpi"
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["--backend auto: the mpi plane (2 ranks share 1 GPU(s) on a node; NCCL needs a GPU per rank)"]


@pytest.mark.usefixtures("one_gpu")
def test_auto_takes_nccl_only_when_every_node_has_a_gpu_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert _chosen("auto", [(1, 1), (1, 1)]) == "nccl"
    assert _chosen("auto", [(1, 1), (2, 1)]) == "mpi"      # the other node's ranks share: every rank alike
    assert _chosen("mpi", [(2, 1), (2, 1)]) == "mpi"
    assert capsys.readouterr().err.count("--backend auto") == 1


@pytest.mark.usefixtures("one_gpu")
def test_nccl_on_a_shared_gpu_is_refused_before_the_plane_starts() -> None:
    with pytest.raises(ConfigError, match="--backend mpi") as refused:
        Context(backend="nccl", device=torch.device("cuda", 0), comm=_Node([(2, 1), (2, 1)]))  # type: ignore[arg-type]
    assert refused.value.knob == "--backend" and "2 ranks share 1 GPU" in refused.value.detail


BIND_PROBE = textwrap.dedent("""
    import os, sys
    import torch

    os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = "1"
    class Bound(Exception):
        pass

    def set_device(device):    # the first GPU made current: was MPI started already?
        raise Bound(f"{{torch.device(device)}} mpi_started={{'mpi4py.MPI' in sys.modules}}")

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    torch.cuda.set_device = set_device
    try:
        {call}
    except Bound as bound:
        print("bound", bound)
""")


@pytest.mark.parametrize("call", [
    "from mpi4dl_nb.__main__ import main; main(['layout', '--split-size', '2'])",
    "from mpi4dl_nb.comm.context import Context; Context()",
    "from mpi4dl_nb.notebook.engine_main import main; main()",
], ids=["cli", "context", "engine"])
def test_the_local_ranks_gpu_is_made_current_before_mpi_starts(call: str) -> None:
    probe = BIND_PROBE.format(call=call)
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "bound cuda:1 mpi_started=False" in done.stdout.splitlines(), done.stdout + done.stderr[-2000:]


def test_notebook_engines_start_through_the_binding_entry() -> None:
    kwargs = Cluster(n=2)._engine_launcher_kwargs()
    assert kwargs["engine_cmd"] == [sys.executable, "-m", "mpi4dl_nb.notebook.engine_main"]
