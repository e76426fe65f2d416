"""Every command block of README.md and docs/*.md runs as written, or is marked as an excerpt
(tests/support/doc_commands.py; the convention: docs/README.md). Nothing runs: each command is parsed with its
command's flags and its layout is checked against the ranks it is launched on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.doc_commands import (
    CodeBlock,
    DocCommandError,
    block_commands,
    check_command_line,
    code_blocks,
    doc_files,
    words_of,
)

BLOCKS = [block for path in doc_files() for block in code_blocks(path) if block_commands(block)]


def failures(block: CodeBlock) -> list[str]:
    """Each command of ``block`` that would not run, with the reason."""
    found = []
    for command in block_commands(block):
        try:
            check_command_line(words_of(command.text))
        except DocCommandError as err:
            found.append(f"{command.where}: {err}\n    {command.text}")
    return found


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.excerpt], ids=lambda block: block.where)
def test_command_block_runs_as_written(block: CodeBlock) -> None:
    wrong = failures(block)
    assert not wrong, ("commands that would not run as written (fix them, or mark the block '<!-- excerpt -->' "
                       "if it is one):\n" + "\n".join(wrong))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.excerpt], ids=lambda block: block.where)
def test_excerpt_holds_a_command_that_does_not_run(block: CodeBlock) -> None:
    assert failures(block), f"{block.where}: every command of this excerpt runs as written: drop its excerpt mark"


def test_the_docs_have_command_blocks_and_excerpts() -> None:
    assert sum(not block.excerpt for block in BLOCKS) >= 30 and sum(block.excerpt for block in BLOCKS) >= 5


def refusal(command: str) -> str:
    """The reason ``command`` would not run ('' when it would)."""
    try:
        check_command_line(words_of(command))
    except DocCommandError as err:
        return str(err)
    return ""


def test_the_check_passes_commands_that_run() -> None:
    for command in ("mpiexec -n 5 python -m mpi4dl_nb train --model resnet --steps 2",
                    "OMP_NUM_THREADS=1 python -m mpi4dl_nb train --split-size 1 --spatial-size 0 --steps 2",
                    "python -m mpi4dl_nb layout --split-size 3 --spatial-size 2   # any layout, printed",
                    "mpiexec -n 9 python -m mpi4dl_nb layout --split-size 3 --spatial-size 2",
                    "mpiexec -n 4 python -m mpi4dl_nb infer --checkpoint ck --slide s.svs --output m.npy "
                    "--num-spatial-parts 4",
                    "mpiexec -n 2 python -m mpi4dl_nb tune --memory-limit-mb 100",
                    "python -m mpi4dl_nb export --checkpoint ck --output-file model.safetensors",
                    "python -m mpi4dl_nb train --help", "make test PYTEST_ARGS=-x", "make readme-outputs",
                    "mpiexec -n 2 python benchmarks/bench_p2p.py --repeats 50", "bash benchmarks/run_all.sh",
                    "python -m mpi4dl_nb.notebook.demo",
                    "python -c \"from mpi4dl_nb.data.synthetic_cohort import write_synthetic_cohort\"",
                    "ls runs | head", "git status"):
        assert refusal(command) == "", command


def test_the_check_refuses_commands_that_do_not_run() -> None:
    expected = {
        "python -m mpi4dl_nb train --cohort c.csv --folds 3": "train needs 5 ranks for its flags, launched with 1",
        "mpiexec -n 4 python -m mpi4dl_nb evaluate --checkpoint ck": "needs 5 ranks",
        "mpiexec -n 5 python -m mpi4dl_nb train --lr-shedule cosine": "--lr-shedule",
        "mpiexec -n 5 python -m mpi4dl_nb train ... --steps 2": "placeholder '...'",
        "mpiexec -n 5 python -m mpi4dl_nb train --datapath $DATA": "placeholder '$DATA'",
        "mpiexec -n <ranks> python -m mpi4dl_nb train": "not a rank count",
        "mpiexec -n 4 python -m mpi4dl_nb train --split-size 1 --spatial-size 1 --num-spatial-parts 4 --batch-size "
        "2 --parts 4": "refused",
        "mpiexec -n 2 python -m mpi4dl_nb infer --checkpoint c --slide s --output o.npy --num-spatial-parts 4":
            "needs 4 ranks",
        "python -m mpi4dl_nb tune --memory-limit-mb 100": "at least 2",
        "mpiexec -n 2 python -m mpi4dl_nb export --checkpoint ck --output-file m.pt": "needs 1 ranks",
        "python -m mpi4dl_nb trian": "no such command",
        "make tests": "no such Makefile target",
        "python benchmarks/bench_nothing.py": "no such file",
        "python -m mpi4dl_nb.nothing": "no such module",
        "python -c \"from mpi4dl_nb.data.synthetic_cohort import nothing_here\"": "has no nothing_here",
    }
    for command, reason in expected.items():
        assert reason in refusal(command), (command, refusal(command))


def test_block_commands_join_lines_and_read_transcripts(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- excerpt -->\n```bash\n# a comment\nmpiexec -n 5 python -m mpi4dl_nb train \\\n"
                    "    --steps 2   # trailing\npython - <<'EOF'\nmpiexec -n 1 in a heredoc\nEOF\n```\n\n"
                    "```\n$ make demo\nrunning ...\nmpiexec -n 2 python x.py\n```\n\n```python\nmake = 1\n```\n")
    blocks = code_blocks(page)
    assert [block.excerpt for block in blocks] == [True, False, False]
    assert [c.text for c in block_commands(blocks[0])] == [
        "mpiexec -n 5 python -m mpi4dl_nb train --steps 2   # trailing", "python - <<'EOF'"]
    assert [c.line for c in block_commands(blocks[0])] == [4, 6]
    assert [c.text for c in block_commands(blocks[1])] == ["make demo", "mpiexec -n 2 python x.py"]
    assert block_commands(blocks[2]) == []
    assert words_of("python - <<'EOF'") == ["python", "-"]
