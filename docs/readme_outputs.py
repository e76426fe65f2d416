"""The sample outputs of README.md and docs/*.md, written from the commands that print them (``make readme-outputs``).

Each sample output sits in its page (README.md, or a page of docs/) between ``<!-- output: NAME -->`` and
``<!-- /output -->``: a fenced block with what the command printed, and a line naming the command, the commit
and the machine. ``SAMPLES`` is the one table of them: the page, the command that page shows, how this script
runs it, and a small configuration that prints the same format fast (``quick``: tests/test_readme_outputs.py
compares the *shape* of its output, numbers masked, with the page's block). A new sample is a row here plus its
two marker lines where it belongs in its page, then ``python docs/readme_outputs.py NAME``.

    python docs/readme_outputs.py            # every sample (the demo takes minutes)
    python docs/readme_outputs.py layout     # some samples (and the ones they need, run first)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = "README.md"
FLAGSHIP_NAME = "04_hybrid_training_pathology.ipynb"
BATCH_JOBS = "docs/batch-jobs.md"
EVALUATION = "docs/evaluation.md"


@dataclass(frozen=True)
class Sample:
    """One sample output of a page: its command, how it is run, and a fast run of the same format."""

    name: str
    command: str                      # as its page shows it (the test finds it in the page's bash blocks)
    caption: str                      # names the command in the line under the block
    run: str | None = None            # what runs it when the page shows another spelling (``make demo``)
    needs: str | None = None          # a sample whose run (same scratch folder) this one reads
    quick: tuple[str, ...] = ()       # fast commands, the last printing the same format ({root}: the checkout)
    json_keys: tuple[str, ...] = ()   # JSON lines shown with these keys only (then ``, ...}``)
    tail: int = 0                     # show only the last lines (0: all)
    hide: str | None = None           # lines left out (a regular expression): logs of other programs
    page: str = README                # the page holding the block, relative to the checkout

    @property
    def path(self) -> Path:
        return ROOT / self.page


LAYOUT_FLAGS = "--num-spatial-parts 4 --slice-method vertical --split-size 2 --spatial-size 1"
TRAIN_FLAGS = ("--model amoebanet --num-layers 6 --num-filters 16 --image-size 256 --num-spatial-parts 4 "
               "--slice-method vertical --split-size 2 --spatial-size 1 --batch-size 2 --steps 3 -v")
EVAL_TRAIN_FLAGS = ("--app medical --num-classes 2 --image-size 128 --batch-size 8 --num-layers 11 --num-filters 8 "
                    "--steps 80 --val-fraction 0.25 --eval-every 20 --log-dir runs/ihc --checkpoint-dir runs/ihc/ckpt "
                    "--keep-best val_loss")
EVALUATE_FLAGS = "--checkpoint runs/ihc/ckpt --checkpoint-select best --app medical --split-size 1 --spatial-size 0"

SAMPLES: tuple[Sample, ...] = (
    Sample("demo", "make demo", "`make demo`", run="python -m mpi4dl_nb.notebook.demo", hide=r"^\[IPKernelApp\]",
           quick=(f"python {{root}}/docs/readme_outputs.py --stand-in-flagship {FLAGSHIP_NAME}",
                  f"python -m mpi4dl_nb.notebook.demo --notebook {FLAGSHIP_NAME}")),
    Sample("layout", f"python -m mpi4dl_nb layout {LAYOUT_FLAGS}", "the `layout` command above",
           quick=(f"python -m mpi4dl_nb layout {LAYOUT_FLAGS}",), page=BATCH_JOBS),
    Sample("train", f"mpiexec -n 5 python -m mpi4dl_nb train {TRAIN_FLAGS}", "the `train` command above",
           json_keys=("model", "images_per_s", "loss", "peak_memory_bytes", "memory_source"), page=BATCH_JOBS,
           quick=("mpiexec -n 2 python -m mpi4dl_nb train --model amoebanet --num-layers 3 --num-filters 4 "
                  "--image-size 32 --split-size 2 --spatial-size 0 --batch-size 2 --steps 1 -v",)),
    Sample("evaluation-train", f"mpiexec -n 5 python -m mpi4dl_nb train {EVAL_TRAIN_FLAGS}",
           "the `train` command above (its last line)", tail=1, page=EVALUATION,
           json_keys=("steps_run", "loss", "val_step", "val_count", "val_loss", "val_accuracy",
                      "val_balanced_accuracy", "val_roc_auc", "best"),
           quick=("mpiexec -n 2 python -m mpi4dl_nb train --app medical --num-classes 2 --image-size 64 "
                  "--batch-size 4 --num-layers 11 --num-filters 4 --steps 2 --val-fraction 0.25 --eval-every 2 "
                  "--log-dir runs/ihc --checkpoint-dir runs/ihc/ckpt --keep-best val_loss --split-size 2 "
                  "--spatial-size 0",)),
    Sample("evaluate", f"python -m mpi4dl_nb evaluate {EVALUATE_FLAGS}",
           "the `evaluate` command above (its last line)", tail=1, needs="evaluation-train", page=EVALUATION,
           json_keys=("checkpoint_select", "best", "step", "model", "split", "world_size", "count", "loss", "accuracy",
                      "balanced_accuracy", "roc_auc", "confusion_matrix"),
           quick=(f"python -m mpi4dl_nb evaluate {EVALUATE_FLAGS}",)),
)
BY_NAME = {sample.name: sample for sample in SAMPLES}


# ---------------------------------------------------------------------- running commands
class CommandFailed(RuntimeError):
    """A sample's command exited with an error; the message holds its output."""


def command_argv(command: str, root: Path = ROOT) -> list[str]:
    """The argv that runs ``command``: ``python`` is this interpreter; ``mpiexec -n N ...`` is built by the
    package's one MPI launcher (comm/launcher.py: only the flags this MPI needs to start N ranks here)."""
    argv = shlex.split(command.format(root=root))
    if argv[:2] == ["mpiexec", "-n"]:
        from mpi4dl_nb.comm.launcher import Launcher

        return Launcher.find().command(int(argv[2]), command_argv(shlex.join(argv[3:]), root), tag_output=False)
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


def run_command(command: str, cwd: Path, timeout: float) -> str:
    """What ``command`` prints (stdout and stderr in one stream, as a terminal shows them), run in ``cwd``
    with this interpreter's folder first on PATH and one thread per process (as the Makefile sets)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(command_argv(command), cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if done.returncode != 0:
        raise CommandFailed(f"{command!r} exited with {done.returncode} in {cwd}:\n{done.stdout[-4000:]}")
    return done.stdout


def run_sample(sample: Sample, cwd: Path, timeout: float, quick: bool = False) -> str:
    """The displayed output of ``sample`` run in ``cwd`` (``quick``: its fast configuration)."""
    commands = sample.quick if quick else (sample.run or sample.command,)
    output = ""
    for command in commands:
        output = run_command(command, cwd, timeout)
    return displayed(output, sample)


def with_needs(names: Iterable[str]) -> list[Sample]:
    """The samples named, after the ones they need, in table order."""
    wanted = set()
    for name in names:
        while name is not None and name not in wanted:
            wanted.add(name)
            name = BY_NAME[name].needs
    return [sample for sample in SAMPLES if sample.name in wanted]


# ---------------------------------------------------------------------- what a block shows
def terminal_lines(output: str) -> list[str]:
    """Lines as a terminal leaves them: a carriage return overwrites its line; no trailing blanks."""
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in output.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def abridged(line: str, keys: Sequence[str]) -> str:
    """A JSON object line cut to ``keys`` (in the line's order), ``, ...}`` marking the keys left out."""
    record = json.loads(line)
    missing = [key for key in keys if key not in record]
    if missing:
        raise KeyError(f"the output's JSON line has no {', '.join(missing)}; keys: {', '.join(record)}")
    kept = {key: value for key, value in record.items() if key in keys}
    text = json.dumps(kept)
    return text[:-1] + ", ...}" if len(kept) < len(record) else text


def displayed(output: str, sample: Sample) -> str:
    """What a page shows of ``output``: terminal lines but hidden ones, the last ``tail``, JSON lines abridged."""
    lines = terminal_lines(output)
    if sample.hide:
        lines = [line for line in lines if not re.search(sample.hide, line)]
    if sample.tail:
        lines = lines[-sample.tail:]
    if sample.json_keys:
        lines = [abridged(line, sample.json_keys) if is_json(line) else line for line in lines]
    return "\n".join(lines)


def is_json(line: str) -> bool:
    """Whether a line of output is one JSON object (a summary line)."""
    return line.startswith("{") and line.endswith("}")


# ---------------------------------------------------------------------- shape (what the test compares)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
PROGRESS_BAR = re.compile(r"\[[#.]+\]")


def line_shape(line: str) -> str:
    """A line without its figures: numbers and progress bars masked, spaces collapsed; a JSON line: its keys."""
    if is_json(line):
        text = line[:-len(", ...}")] + "}" if line.endswith(", ...}") else line
        return "json: " + ", ".join(json.loads(text))
    return " ".join(PROGRESS_BAR.sub("[bar]", NUMBER.sub("#", line)).split())


def shape(text: str) -> list[str]:
    """The shape of an output: its lines' shapes in order, runs of alike lines (rank rows, steps) as one, then
    its JSON lines' shapes (JSON goes to stdout and the report to stderr: under mpiexec the two interleave in
    either order)."""
    shapes: list[str] = []
    json_shapes: list[str] = []
    for line in text.splitlines():
        masked = line_shape(line)
        if masked.startswith("json:"):
            json_shapes.append(masked)
        elif masked and (not shapes or shapes[-1] != masked):
            shapes.append(masked)
    return shapes + json_shapes


# ---------------------------------------------------------------------- the pages' blocks
BLOCK = re.compile(r"(<!-- output: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /output -->)", re.S)
FENCE = re.compile(r"```text\n(?P<output>.*?)\n```", re.S)


def output_blocks(text: str) -> dict[str, str]:
    """A page's sample outputs by name (the fenced text between the markers)."""
    blocks = {}
    for match in BLOCK.finditer(text):
        fence = FENCE.search(match["body"])
        if fence is None:
            raise ValueError(f"output block {match['name']!r} has no ```text fence")
        blocks[match["name"]] = fence["output"]
    return blocks


def provenance() -> str:
    """The commit, date and machine a run happens at (a dirty package tree says so)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "an unknown commit"
    if git("status", "--porcelain", "--", "mpi4dl_nb", "notebooks"):
        commit += " with uncommitted changes"
    load = os.getloadavg()[0]
    return f"at {commit}, {datetime.date.today()}, {os.cpu_count()} cores (load {load:.1f})"


def block_body(sample: Sample, output: str, where: str) -> str:
    notes = ["JSON abridged to some keys"] if sample.json_keys else []
    notes += ["log lines of other programs left out"] if sample.hide else []
    abridged_note = "".join(f"; {note}" for note in notes)
    return (f"```text\n{output}\n```\n\n*Printed by {sample.caption} {where}; written by `make readme-outputs` "
            f"(`docs/readme_outputs.py`){abridged_note}.*\n")


def replace_block(text: str, name: str, body: str, page: str = README) -> str:
    """The ``text`` of ``page`` with block ``name``'s content replaced by ``body``."""
    matches = [m for m in BLOCK.finditer(text) if m["name"] == name]
    if len(matches) != 1:
        raise ValueError(f"{page} needs exactly one '<!-- output: {name} -->' ... '<!-- /output -->' pair "
                         f"where the sample belongs; found {len(matches)}")
    match = matches[0]
    return text[:match.start("body")] + body + text[match.end("body"):]


# ---------------------------------------------------------------------- the stand-in flagship (quick demo)
def write_stand_in_flagship(path: Path) -> None:
    """A one-cell notebook printing a summary line as notebook 04 does (the demo's format, in seconds)."""
    import nbformat

    from mpi4dl_nb.config import ParallelConfig

    cfg = ParallelConfig(split_size=2, spatial_size=1, num_spatial_parts=4, slice_method="square", balance=[4, 1])
    ranks = cfg.world_size
    summary = {"configuration": cfg.as_dict(), "world_size": ranks, "image_size": 128, "batch_size": 2,
               "steps": 3, "exact": True, "max_loss_error": 0.0, "max_weight_error": 1e-15,
               "images_per_second": 1.0, "serial_images_per_second": 1.0, "serial_memory_mb": 1.0,
               "memory_ratio": 1.0, "memory_measured_mb": [1.0] * ranks, "memory_estimate_mb": [1.0] * ranks,
               "held_out_steps": [4, 24], "held_out_accuracy": [0.5, 1.0], "chance_accuracy": 0.5,
               "held_out_images": 32, "held_out_crops": 4, "curve_steps": 24, "curve_batch_size": 4}
    cell = nbformat.v4.new_code_cell(f"print('MPI4DL_SUMMARY ' + {json.dumps(summary)!r})")
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)


# ---------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"samples to write (default all: {', '.join(BY_NAME)})")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per command")
    parser.add_argument("--stand-in-flagship", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stand_in_flagship is not None:
        write_stand_in_flagship(args.stand_in_flagship)
        return 0
    unknown = [name for name in args.names if name not in BY_NAME]
    if unknown:
        parser.error(f"unknown sample(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    failed = []
    with tempfile.TemporaryDirectory(prefix="readme-outputs-") as scratch:
        for sample in with_needs(args.names or BY_NAME):
            print(f"{sample.name}: {sample.run or sample.command}", flush=True)
            where = provenance()
            try:
                output = run_sample(sample, Path(scratch), args.timeout)
            except (CommandFailed, KeyError, subprocess.TimeoutExpired) as err:
                print(f"{sample.name}: failed: {err}", file=sys.stderr)
                failed.append(sample.name)
                continue
            body = block_body(sample, output, where)
            sample.path.write_text(replace_block(sample.path.read_text(), sample.name, body, sample.page))
            print(output + "\n", flush=True)
    if failed:
        print(f"not written: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
