"""The sample outputs of README.md and docs/*.md (written by docs/readme_outputs.py): each block is a sample of its
table on the page the table names, shows the output of a command that page shows, and has the shape that command
prints today (a fast configuration of it, run here: numbers masked, lines in order, JSON keys)."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_outputs", REPO / "docs" / "readme_outputs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


outputs = _load_script()
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def one_line(command: str) -> str:
    """A command with its line continuations joined and its spaces collapsed."""
    return " ".join(command.replace("\\\n", " ").split())


def page_code(text: str) -> str:
    """A page's bash blocks, each command on one line."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return "\n".join(one_line(line) for block in blocks for line in block.replace("\\\n", " ").splitlines())


def launches(sample: object) -> bool:
    """Whether the fast run of ``sample`` (and of the samples it needs) starts an MPI job."""
    while sample is not None:
        if any(command.startswith("mpiexec") for command in sample.quick):
            return True
        sample = outputs.BY_NAME.get(sample.needs) if sample.needs else None
    return False


SAMPLE_PARAMS = [pytest.param(sample, id=sample.name, marks=[pytest.mark.mpi] if launches(sample) else [])
                 for sample in outputs.SAMPLES]


def test_shape_masks_figures_keeps_order_and_puts_json_last() -> None:
    text = ('[###.......] step 1/3 loss 2.0278 0.48 img/s\n[##########] step 3/3 loss 2.3352 0.68 img/s\n'
            '{"model": "amoebanet", "loss": 2.3, ...}\n   0      7.6    1.95\n   1     10.2   12.75\nend')
    assert outputs.shape(text) == ["[bar] step #/# loss # # img/s", "# # #", "end", "json: model, loss"]
    assert outputs.shape(text.replace("end", "done")) != outputs.shape(text)
    assert outputs.abridged('{"a": 1, "b": [2], "c": 3}', ("a", "c")) == '{"a": 1, "c": 3, ...}'
    assert outputs.terminal_lines("step 1\rstep 2\nend  \n\n") == ["step 2", "end"]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_block_is_a_sample_of_its_page(page: Path) -> None:
    shown = sorted(outputs.output_blocks(page.read_text()))
    expected = sorted(sample.name for sample in outputs.SAMPLES if sample.path == page)
    assert shown == expected, f"{page.name}'s output blocks {shown} are not the samples docs/readme_outputs.py " \
                              f"writes there {expected}"


def test_every_sample_has_its_page() -> None:
    assert all(sample.path in PAGES for sample in outputs.SAMPLES), [s.page for s in outputs.SAMPLES]


@pytest.mark.parametrize("sample", outputs.SAMPLES, ids=lambda sample: sample.name)
def test_page_shows_the_command_of_its_sample(sample) -> None:
    assert one_line(sample.command) in page_code(sample.path.read_text()), (
        f"{sample.page} shows no bash command {sample.command!r}; its sample output {sample.name!r} is that "
        f"command's")


@pytest.fixture(scope="module")
def quick_output(tmp_path_factory: pytest.TempPathFactory) -> Callable[[object], str]:
    """``quick_output(sample)``: what the fast configuration of ``sample`` prints, as its page shows it; the
    samples it needs run first, in the same folder."""
    folder = tmp_path_factory.mktemp("readme-outputs")
    done: dict[str, str] = {}

    def run(sample) -> str:
        for needed in outputs.with_needs([sample.name]):
            if needed.name not in done:
                done[needed.name] = outputs.run_sample(needed, folder, timeout=300, quick=True)
        return done[sample.name]

    return run


@pytest.mark.parametrize("sample", SAMPLE_PARAMS)
def test_readme_block_has_the_shape_of_the_command_output(sample, quick_output) -> None:
    shown = outputs.shape(outputs.output_blocks(sample.path.read_text())[sample.name])
    printed = outputs.shape(quick_output(sample))
    assert shown == printed, (
        f"{sample.page}'s {sample.name!r} output no longer has the format the command prints; rerun "
        f"`make readme-outputs SAMPLES={sample.name}`.\nshown:   {shown}\nprinted: {printed}")
