"""Several test programs in one launch (tests/support/battery.py): each job's checks carry its label,
and a job that runs past its own time limit aborts the launch, naming itself."""

from __future__ import annotations

import gc
import importlib
import json
import resource
import sys
import threading
import time

import torch
from mpi4py import MPI

from mpi4dl_nb.comm.context import abort_job
from tests.support.battery import END, check_prefix, job_label
from tests.support.bf16_rule import pin_bf16_kernels
from tests.support.checks import Checks, run_checks


def over_time(label: str, seconds: float) -> None:
    print(f"rank {MPI.COMM_WORLD.rank}: job {label!r} ran past its {seconds:.0f} s limit; aborting the launch",
          file=sys.stderr, flush=True)
    abort_job(MPI.COMM_WORLD, 1)     # the launcher forwards the line first (a bare Abort lost it in one CI run)


def main(check: Checks) -> None:
    fresh_seed = torch.initial_seed()
    for program, timeout, *args in json.loads(sys.argv[1]):
        module = importlib.import_module(f"tests.mpi.{program}")
        sys.argv = [str(module.__file__), *args]
        torch.manual_seed(fresh_seed)            # the random state of a fresh process
        check.prefix = check_prefix(program, args)
        limit = threading.Timer(timeout, over_time, args=(job_label(program, args), timeout))
        limit.daemon = True
        limit.start()
        cpu = time.process_time()
        with check(END) as outcome:              # raising outside its checks fails this check
            module.main(check)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # kB on Linux
            outcome.detail = f"cpu {time.process_time() - cpu:.1f}s, peak rss so far {peak:.0f} MB"   # its cost
        limit.cancel()
        check.prefix = ""
        gc.collect()


if __name__ == "__main__":
    pin_bf16_kernels()     # the programs' bf16 runs share the process: before any convolution
    run_checks(main)
