"""``python -m mpi4dl_nb {layout,train,evaluate,infer,tune} ...``: the batch-job entry point (cli/commands.py)."""
from __future__ import annotations

import sys

from .cli.commands import main
from .run.teardown import exit_watched

if __name__ == "__main__":
    sys.exit(exit_watched(main, sys.argv[1:]))     # a job's monitor listens on through MPI's teardown (run/teardown.py)
