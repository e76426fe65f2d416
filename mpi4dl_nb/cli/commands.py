"""The command table of ``python -m mpi4dl_nb``: each command's module, parser and one-line summary, and the
dispatch."""
from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class Command:
    """One ``python -m mpi4dl_nb <name>`` command: the module whose ``main(argv)`` runs it and whose function
    ``parser_function`` makes its parser (``--config`` asks it which flags the other commands take)."""

    name: str
    module: str
    parser_function: str
    summary: str

    def entry(self) -> Callable[[Sequence[str]], int]:
        main: Callable[[Sequence[str]], int] = import_module(self.module, __package__).main
        return main

    def parser(self) -> argparse.ArgumentParser:
        """The command's parser (its flags; nothing parsed)."""
        make: Callable[[], argparse.ArgumentParser] = getattr(import_module(self.module, __package__),
                                                              self.parser_function)
        return make()


COMMANDS: tuple[Command, ...] = (
    Command("layout", ".layout_cmd", "layout_parser",
            "show which rank does what for the MPI4DL flags, and how many ranks they need"),
    Command("train", ".train_cmd", "train_parser",
            "train a model (mpiexec -n <ranks> python -m mpi4dl_nb train --model ...)"),
    Command("evaluate", ".evaluate_cmd", "evaluate_parser",
            "a checkpoint on its held-out images, any rank layout: one JSON line"),
    Command("infer", ".infer_cmd", "infer_parser",
            "a trained checkpoint over a whole slide (mpiexec -n <parts> ... infer --slide)"),
    Command("tune", ".tune_cmd", "tune_parser",
            "run the planner's best configurations on this job, pick the fastest that fits"),
    Command("export", ".export_cmd", "export_parser",
            "a checkpoint's model as a state dict under the model's own keys (.safetensors or .pt)"),
)
COMMAND_NAMES = tuple(command.name for command in COMMANDS)


def usage() -> str:
    names = ",".join(c.name for c in COMMANDS)
    lines = [f"usage: python -m mpi4dl_nb {{{names}}} [flags]", ""]
    lines += [f"  {c.name:<8} {c.summary}" for c in COMMANDS]
    lines += ["", "'python -m mpi4dl_nb <command> --help' lists the flags of a command; '--config FILE.toml' gives "
                  "them from a file (docs/batch-jobs.md)."]
    return "\n".join(lines)


def _whole_lines(stream: object) -> None:
    """Write each line as it ends: under ``mpiexec -prepend-rank`` and in batch logs a block-buffered pipe would
    cut long lines into pieces (each prefixed) and hold progress back."""
    if isinstance(stream, io.TextIOWrapper):
        stream.reconfigure(line_buffering=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command named by the first argument with the rest; usage on none, -h or an unknown name."""
    args = list(sys.argv[1:] if argv is None else argv)
    _whole_lines(sys.stdout)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    by_name = {c.name: c for c in COMMANDS}
    command = by_name.get(args[0])
    if command is None:
        print(f"unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return command.entry()(args[1:])
