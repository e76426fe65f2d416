"""Shared-launch self-test: one named check ('pass'; 'fail': it fails on rank 1), or a raise outside
any check ('raise'); the check's detail is the first random number of the job."""

import sys

import torch

from tests.support.checks import Checks, run_checks

NAME = "the same name in every job"


def main(check: Checks) -> None:
    mode = sys.argv[1]
    with check(NAME) as result:
        result.detail = f"{torch.rand(1).item():.12f}"
        assert not (mode == "fail" and check.rank == 1), "rank 1 disagrees"
    if mode == "raise":
        raise RuntimeError("deliberate failure outside any check")


if __name__ == "__main__":
    run_checks(main)
