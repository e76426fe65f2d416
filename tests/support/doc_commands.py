"""The command lines of README.md and docs/*.md: found in their fenced blocks and checked without running them.

A command block is a fenced block labelled ``bash`` (every line a command), or any other block except ``python``
and ``json`` whose lines start with ``$ `` (a transcript: those lines are the commands, the rest their output) or
with ``mpiexec`` / ``python -m mpi4dl_nb``. A block whose fence follows a line ``<!-- excerpt -->`` is an excerpt
(placeholders such as ``...``, ``<same flags>``, ``$DATA``): its commands are not checked, but at least one of
them must fail the check (else the mark is not needed). docs/README.md states this convention.

``check_command_line(words)`` raises ``DocCommandError`` with the reason when a command would not run as written:
``python -m mpi4dl_nb <command> ...`` (with or without ``mpiexec -n N``) must parse with that command's flags and
its parallel layout must need exactly N ranks (1 without ``mpiexec``); ``make T`` must name a Makefile target;
``python F.py``, ``bash F`` and ``sbatch F`` must name a file of the checkout; ``python -m M`` an importable
module; ``python -c CODE`` must compile and its ``from mpi4dl_nb... import`` names exist. Only ``ranks_needed``
knows the command-line parsers (see its docstring).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXCERPT_MARK = "<!-- excerpt -->"
NOT_COMMANDS = ("python", "json")          # blocks of code and data, never commands
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
PLACEHOLDER = re.compile(r"\.\.\.|<[^<>\s][^<>]*>|\$\w|\$\{")
# launcher flags and how many words follow each (others: none)
LAUNCHER_FLAG_VALUES = {"-n": 1, "-np": 1, "-f": 1, "-hosts": 1, "-host": 1, "--hostfile": 1, "-hostfile": 1,
                        "-ppn": 1, "-x": 1, "-genv": 2}
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}


class DocCommandError(ValueError):
    """A documented command that would not run as written; the message says why."""


@dataclass(frozen=True)
class CodeBlock:
    """A fenced block of a Markdown file: its language, first content line (1-based) and lines."""

    path: Path
    line: int
    lang: str
    lines: tuple[str, ...]
    excerpt: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


@dataclass(frozen=True)
class DocCommand:
    """One command of a block, its line continuations joined."""

    block: CodeBlock
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.block.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every page of docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_blocks(path: Path) -> list[CodeBlock]:
    """The fenced blocks of a Markdown file, each with the excerpt mark it carries (the line before its fence)."""
    lines = path.read_text().splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        before = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
        indent = len(opening["indent"])
        body = tuple(line[indent:] if line[:indent].isspace() else line for line in lines[index + 1:end])
        blocks.append(CodeBlock(path, index + 2, opening["lang"], body, before == EXCERPT_MARK))
        index = end + 1
    return blocks


def is_command_start(line: str) -> bool:
    """Whether a line of a block that is not ``bash`` is a command: a transcript's ``$ `` line, or a launch."""
    return line.startswith("$ ") or line.startswith(("mpiexec ", "python -m mpi4dl_nb "))


def block_commands(block: CodeBlock) -> list[DocCommand]:
    """The commands of a block, line continuations joined; heredoc bodies (``<<'EOF'`` ... ``EOF``) left out."""
    if block.lang in NOT_COMMANDS:
        return []
    commands = []
    pending: list[str] = []
    start = 0
    heredoc_end: str | None = None
    for offset, raw in enumerate(block.lines):
        if heredoc_end is not None:
            heredoc_end = None if raw.strip() == heredoc_end else heredoc_end
            continue
        line = raw
        if not pending:
            if block.lang != "bash" and not is_command_start(line):
                continue
            line = line[2:] if line.startswith("$ ") else line
            start = block.line + offset
        pending.append(line.rstrip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            text = " ".join(part.strip() for part in pending).strip()
            pending = []
            heredoc = re.search(r"<<-?\s*'?(\w+)'?", text)
            heredoc_end = heredoc.group(1) if heredoc else None
            if text and not text.startswith("#"):
                commands.append(DocCommand(block, start, text))
    return commands


def all_commands() -> Iterator[DocCommand]:
    for path in doc_files():
        for block in code_blocks(path):
            yield from block_commands(block)


def words_of(text: str) -> list[str]:
    """A command's words as the shell splits them (comments dropped), up to its first shell operator."""
    words = shlex.split(text, comments=True)
    for index, word in enumerate(words):
        if word in SHELL_OPERATORS or word.startswith(("<<", ">", "2>")):
            return words[:index]
    return words


# ---------------------------------------------------------------------- the check
def check_command_line(words: Sequence[str]) -> None:
    """Raise DocCommandError naming why the command ``words`` would not run as written (None: it would, as far as
    can be told without data and minutes)."""
    words = list(words)
    while words and re.match(r"^\w+=", words[0]):          # NAME=value before the command
        words.pop(0)
    if not words:
        return
    ranks, words = launch(words)
    program = Path(words[0]).name if words else ""
    if program in ("python", "python3"):
        check_python(words[1:], ranks)
    elif ranks is not None:
        raise DocCommandError(f"mpiexec launches {words[:1]}: only python programs are launched here")
    elif program == "make":
        check_make(words[1:])
    elif program in ("bash", "sbatch", "sh"):
        scripts = [word for word in words[1:] if not word.startswith("-")]
        check_file(scripts[0] if scripts else "", program)


def launch(words: list[str]) -> tuple[int | None, list[str]]:
    """The rank count of an ``mpiexec -n N ...`` (or ``engines/hosts/mpiexec``) launch and the launched words;
    (None, words) without a launcher."""
    if Path(words[0]).name not in ("mpiexec", "mpirun"):
        return None, words
    ranks = None
    index = 1
    while index < len(words) and words[index].startswith("-"):
        flag = words[index]
        if flag in ("-n", "-np"):
            count = words[index + 1] if index + 1 < len(words) else ""
            if not count.isdigit():
                raise DocCommandError(f"mpiexec {flag} {count!r}: not a rank count")
            ranks = int(count)
        index += 1 + LAUNCHER_FLAG_VALUES.get(flag, 0)
    if ranks is None:
        raise DocCommandError("mpiexec without -n N: say how many ranks")
    return ranks, words[index:]


def check_python(args: list[str], ranks: int | None) -> None:
    """``python -m mpi4dl_nb ...``, ``python -m M``, ``python -c CODE``, ``python F.py`` (``-`` reads stdin)."""
    if not args or args[0] == "-":
        return
    if args[0] == "-c":
        check_code(args[1] if len(args) > 1 else "")
    elif args[0] == "-m":
        module = args[1] if len(args) > 1 else ""
        if module == "mpi4dl_nb":
            check_mpi4dl_nb(args[2:], ranks)
        elif not module_exists(module):
            raise DocCommandError(f"python -m {module}: no such module")
    else:
        check_file(args[0], "python")


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def check_code(code: str) -> None:
    """``python -c CODE``: it compiles, and the names it imports from mpi4dl_nb exist."""
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        raise DocCommandError(f"python -c: does not compile: {err}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpi4dl_nb"):
            module = importlib.import_module(node.module)
            missing = [alias.name for alias in node.names if not hasattr(module, alias.name)
                       and not module_exists(f"{node.module}.{alias.name}")]
            if missing:
                raise DocCommandError(f"python -c: {node.module} has no {', '.join(missing)}")


def check_file(path: str, program: str) -> None:
    if not path or not (REPO / path).is_file():
        raise DocCommandError(f"{program} {path}: no such file in the checkout")


def check_make(args: list[str]) -> None:
    """``make [T ...] [NAME=value ...]``: every T a target of the Makefile."""
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, re.M))
    unknown = [word for word in args if "=" not in word and not word.startswith("-") and word not in targets]
    if unknown:
        raise DocCommandError(f"make {' '.join(unknown)}: no such Makefile target")


def check_mpi4dl_nb(argv: list[str], ranks: int | None) -> None:
    """``python -m mpi4dl_nb <command> ...``: no placeholder, the flags parse, the layout needs the ranks given."""
    if not argv:
        raise DocCommandError("python -m mpi4dl_nb without a command")
    placeholders = [word for word in argv if PLACEHOLDER.search(word)]
    if placeholders:
        raise DocCommandError(f"placeholder {placeholders[0]!r}: mark the block as an excerpt ({EXCERPT_MARK})")
    needed = ranks_needed(argv[0], argv[1:], launched=ranks is not None)
    if needed is None:
        return
    low, high = needed
    given = 1 if ranks is None else ranks
    if given < low or (high is not None and given > high):
        count = str(low) if low == high else f"at least {low}"
        how = f"mpiexec -n {low}" if low > 1 else "no mpiexec (or -n 1)"
        raise DocCommandError(f"{argv[0]} needs {count} ranks for its flags, launched with {given}: use {how} or "
                              f"other layout flags")


def ranks_needed(command: str, argv: list[str], launched: bool) -> tuple[int, int | None] | None:
    """The range of rank counts (low, high or None: no bound) that ``python -m mpi4dl_nb <command> argv`` runs on,
    after its flags parse; None when it exits at once (``--help``). DocCommandError when the flags do not parse
    or the layout is refused.

    The one place that knows the command-line parsers: ``train``, ``evaluate``, ``layout``: the parallel flags'
    ``ParallelConfig`` (its ``world_size``, validated with the batch and image size given); ``infer``: the tile
    grid of ``--num-spatial-parts`` and ``--slice-method``; ``tune``: 2 ranks or more; ``export``: one process;
    ``layout`` without a launcher prints any layout.
    """
    from mpi4dl_nb.cli import evaluate_cmd, export_cmd, infer_cmd, layout_cmd, train_cmd, tune_cmd
    from mpi4dl_nb.cli.args import config_from_args
    from mpi4dl_nb.cli.job_flags import keyword_values
    from mpi4dl_nb.errors import ConfigError
    from mpi4dl_nb.infer.job import InferJob
    from mpi4dl_nb.run.evaluate_job import EvaluateJob
    from mpi4dl_nb.run.job import TrainJob
    from mpi4dl_nb.schema import build_job

    parsers = {"train": train_cmd.train_parser, "evaluate": evaluate_cmd.evaluate_parser,
               "infer": infer_cmd.infer_parser, "tune": tune_cmd.tune_parser, "layout": layout_cmd.layout_parser,
               "export": export_cmd.export_parser}
    jobs: dict[str, type] = {"train": TrainJob, "evaluate": EvaluateJob, "infer": InferJob}
    if command not in parsers:
        raise DocCommandError(f"python -m mpi4dl_nb {command}: no such command (known: {', '.join(parsers)})")
    args = parsed(parsers[command](), argv, command)
    if args is None:
        return None
    try:
        # the job as built from these flags: every check that reads no data
        job = build_job(jobs[command], keyword_values(args, jobs[command]), command) if command in jobs else None
        if command == "tune":
            return 2, None
        if command == "export":
            return 1, 1
        if command == "infer":
            from mpi4dl_nb.spatial.geometry import TileGrid

            assert isinstance(job, InferJob)
            return (TileGrid.from_slice_method(job.slice_method, job.num_spatial_parts).num_tiles,) * 2
        cfg = config_from_args(args)
        if command == "layout" and not launched:
            return 1, None
        sizes = {"batch_size": getattr(args, "batch_size", None), "image_size": getattr(args, "image_size", None)}
        cfg.validate(**{key: value for key, value in sizes.items() if value is not None})
    except ConfigError as err:
        raise DocCommandError(f"{command}: refused: {err}") from None
    return cfg.world_size, cfg.world_size



def parsed(parser: argparse.ArgumentParser, argv: list[str], command: str) -> argparse.Namespace | None:
    """``argv`` parsed (None: it asked for help); DocCommandError with the parser's error line on an error."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as stop:
        if stop.code == 0:
            return None
        lines = [line for line in errors.getvalue().splitlines() if "error:" in line]
        raise DocCommandError(f"{command}: {lines[0] if lines else 'the flags do not parse'}") from None
