"""README's "Python API" block, run as written on 5 ranks: its gathered feature map equals one process's
and its first training step's loss equals a serial step's.
Usage: mpiexec -n 5 python -m mpi4py -m tests.mpi.readme_api. Named checks: RUNS, FEATURES, LOSS (every rank)."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from mpi4dl_nb.comm.context import init
from mpi4dl_nb.models import build_model
from tests.support.checks import Checks, run_checks
from tests.support.exactness import relative_error

README = Path(__file__).resolve().parents[2] / "README.md"
RUNS = "README's Python API block runs as written"
FEATURES = "its gathered feature map equals one process's"
LOSS = "its training step's loss equals one process's"
CHECKS = (RUNS, FEATURES, LOSS)
RTOL = 1e-5     # float32, as the block runs


def api_block() -> str:
    """The python block under README's "## Python API" heading."""
    section = README.read_text().split("\n## Python API\n", 1)[1]
    found = re.search(r"```python\n(.*?)\n```", section, re.S)
    assert found is not None, "README's Python API section has no python block"
    return found.group(1)


def main(check: Checks) -> None:
    namespace: dict[str, object] = {"__name__": "readme_api"}
    with check(RUNS):
        exec(compile(api_block(), str(README), "exec"), namespace)
    ctx = init()
    torch.manual_seed(0)                      # the block's layers and batch, in one process
    layers = build_model("resnet", num_layers=11, num_filters=8, num_classes=2)
    images, labels = torch.randn(2, 3, 64, 64), torch.tensor([0, 1])
    model = nn.Sequential(*layers)
    with check(FEATURES) as result:
        if ctx.rank < 4:
            y = namespace["y"]
            assert isinstance(y, torch.Tensor)
            with torch.no_grad():
                expected = model[:-1](images)
            error = relative_error(y.detach(), expected)
            assert error <= RTOL, f"feature map relative error {error:.1e}"
            result.detail = f"relative error {error:.1e}"
    with check(LOSS) as result:
        loss = namespace["loss"]
        assert isinstance(loss, float)
        expected_loss = float(nn.functional.cross_entropy(model(images), labels))
        assert abs(loss - expected_loss) <= RTOL * abs(expected_loss), f"loss {loss} vs one process {expected_loss}"
        result.detail = f"loss {loss:.6f}"
    ctx.barrier()


if __name__ == "__main__":
    run_checks(main)
