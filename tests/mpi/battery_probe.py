"""Shared-launch self-test: one named check ('pass'; 'fail': it fails on rank 1), then a raise outside
any check ('raise') or a hang ('hang'); the check's detail is the job's first random number."""

import sys
import time

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
    if mode == "hang":
        time.sleep(3600)


if __name__ == "__main__":
    run_checks(main)
