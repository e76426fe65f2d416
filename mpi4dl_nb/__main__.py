"""``python -m mpi4dl_nb {layout,train,evaluate,infer,tune} ...``: the batch-job entry point."""
from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m mpi4dl_nb {layout,train,evaluate,infer,tune} [flags]

  layout   show which rank does what for the MPI4DL flags, and how many ranks they need
  train    train ResNet/AmoebaNet-D (mpiexec -n <ranks> python -m mpi4dl_nb train --model ...)
  evaluate a checkpoint on its held-out images, any rank layout: one JSON line of metrics
  infer    a trained checkpoint over a whole slide, heat map out (mpiexec -n <parts> ... infer --slide ...)
  tune     run the planner's best configurations on this job, pick the fastest that fits

'python -m mpi4dl_nb <command> --help' lists the flags of a command."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "layout":
        from .run.layout_cmd import main as layout_main

        return layout_main(rest)
    if command == "train":
        from .run.train_cmd import main as train_main

        return train_main(rest)
    if command == "evaluate":
        from .run.evaluate_cmd import main as evaluate_main

        return evaluate_main(rest)
    if command == "infer":
        from .run.infer_cmd import main as infer_main

        return infer_main(rest)
    if command == "tune":
        from .run.tune_cmd import main as tune_main

        return tune_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
