"""Several test programs in one launch (tests/support/battery.py): each job's checks carry its label."""

from __future__ import annotations

import gc
import importlib
import json
import sys

import torch

from tests.support.battery import END, check_prefix
from tests.support.checks import Checks, run_checks


def main(check: Checks) -> None:
    fresh_seed = torch.initial_seed()
    for program, *args in json.loads(sys.argv[1]):
        module = importlib.import_module(f"tests.mpi.{program}")
        sys.argv = [str(module.__file__), *args]
        torch.manual_seed(fresh_seed)            # the random state of a fresh process
        check.prefix = check_prefix(program, args)
        with check(END):                         # raising outside its checks fails this check
            module.main(check)
        check.prefix = ""
        gc.collect()


if __name__ == "__main__":
    run_checks(main)
