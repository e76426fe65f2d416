"""README's Python API block runs as written under mpiexec -n 5 and computes what one process computes."""
from __future__ import annotations

from tests.mpi import readme_api
from tests.support.battery import shared_job

JOB = shared_job(5, "readme_api", timeout=300)


def test_readme_python_api_block_runs_on_five_ranks(shared_launch):
    shared_launch(JOB).require_clean(readme_api.CHECKS)
