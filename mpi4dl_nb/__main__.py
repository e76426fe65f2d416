"""``python -m mpi4dl_nb {layout,train,evaluate,infer,tune} ...``: the batch-job entry point (cli/commands.py)."""
from __future__ import annotations

import sys

from .cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
