"""Every knob declared once (issue 63): an option several jobs take means the same in each (type, parser, bounds,
choices, switch-ness, help; only its default and where a job's help lists it differ), one name one kind of value
(``--json`` a switch, ``--resume`` a path), the former spellings still accepted with a notice naming the new one."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections import defaultdict
from pathlib import Path

import pytest

import mpi4dl_nb
from mpi4dl_nb.cli import infer_cmd
from mpi4dl_nb.cli.tune_cmd import TuneJob, tune_job, tune_parser
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.infer.job import Applies, InferJob
from mpi4dl_nb.schema import FLAG_KEY, Flag, build_job, renamed_notice, tagged

PACKAGE = Path(mpi4dl_nb.__file__).resolve().parent
SLIDE = ["--checkpoint", "ck", "--slide", "s.svs", "--output", "m.npy"]
TUNE = ["--memory-limit-mb", "100"]


def declarations() -> dict[str, list[tuple[str, Flag]]]:
    """Every flag-bearing field of every dataclass of the package (its jobs and the parts they hold), by option:
    (where, its Flag)."""
    found: dict[str, list[tuple[str, Flag]]] = defaultdict(list)
    seen: set[int] = set()
    for info in pkgutil.walk_packages(mpi4dl_nb.__path__, "mpi4dl_nb."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if not (isinstance(value, type) and dataclasses.is_dataclass(value)) or value.__module__ != info.name:
                continue
            for f in dataclasses.fields(value):
                given = f.metadata.get(FLAG_KEY)
                if isinstance(given, Flag) and id(f) not in seen:     # an inherited field counts once
                    seen.add(id(f))
                    found[given.option].append((f"{value.__qualname__}.{f.name}", given))
    return found


@pytest.fixture(scope="module")
def flags() -> dict[str, list[tuple[str, Flag]]]:
    return declarations()


def test_the_walk_finds_every_job(flags):
    places = {where.split(".")[0] for declared in flags.values() for where, _ in declared}
    assert {"ParallelConfig", "TrainingSpec", "EvaluateJob", "InferJob", "TuneJob", "LayoutJob", "DataChoice",
            "ModelChoice", "RunOptions", "CheckpointSpec", "DeviceChoice", "ResolutionChoice"} <= places
    assert len(flags) > 100


def test_an_option_several_jobs_take_means_the_same_in_each(flags):
    """Type (its parser), bounds, choices, switch-ness, help, metavar ... alike wherever an option is declared;
    only the default (and the help group, a hidden flag) a job's own."""
    shared = {option: declared for option, declared in flags.items() if len(declared) > 1}
    assert {"--num-spatial-parts", "--slice-method", "--slide-level", "--batch-size", "--image-size", "--num-layers",
            "--num-filters", "--num-epochs", "--dtype", "--model", "--task"} <= set(shared)
    for option, declared in shared.items():
        first_where, first = declared[0]
        for where, given in declared[1:]:
            assert given.meaning == first.meaning, f"{option}: {where} declares it otherwise than {first_where}"


@pytest.mark.parametrize("option, switch", [("--json", True), ("--resume", False)])
def test_one_name_one_kind_of_value(flags, option, switch):
    """``--json`` is layout's switch (tune's JSON file: ``--save-json PATH``); ``--resume`` train's checkpoint
    (infer's partial outputs: ``--resume-outputs``)."""
    assert flags[option] and all(given.switch is switch for _, given in flags[option])
    renamed = [(where, given) for declared in flags.values() for where, given in declared if option in given.old]
    assert renamed and all(given.switch is not switch for _, given in renamed)    # the other meaning, renamed


def test_a_former_spelling_is_no_current_flag_of_its_job(flags):
    for declared in flags.values():
        for where, given in declared:
            job = where.split(".")[0]
            for old in given.old:
                assert not any(other.split(".")[0] == job for other, _ in flags.get(old, [])), (where, old)


def test_dtypes_are_defined_once():
    """The names ``--dtype`` takes (comm/messages.py's DTYPES are the torch dtypes a message may carry)."""
    names = re.compile(r"^\w*DTYPES\s*=\s*\(\s*\"float32\"", re.M)
    defined = [path for path in PACKAGE.rglob("*.py") if names.search(path.read_text())]
    assert [p.relative_to(PACKAGE).as_posix() for p in defined] == ["config.py"]


def test_infer_tags_its_flags_not_tables_of_names():
    window_maps = {item.flag.option for item in tagged(InferJob, Applies.WINDOW_MAPS)}
    slides = {item.flag.option for item in tagged(InferJob, Applies.SLIDES)}
    assert {"--window", "--task", "--model", "--summary", "--resume-outputs", "--batch-windows"} <= window_maps
    assert {"--slide-level", "--mpp", "--magnification", "--source-mpp", "--batch-windows"} <= slides
    assert not {"--window", "--dtype", "--num-spatial-parts"} & slides


@pytest.mark.parametrize("argv, option, detail", [
    (["--batch-windows", "0"], "--batch-windows", ">= 1"), (["--overlay-side", "8"], "--overlay-side", ">= 16"),
    (["--threshold", "1.5"], "--threshold", "<= 1"), (["--num-spatial-parts", "0"], "--num-spatial-parts", ">= 1"),
    (["--slide-level", "-1"], "--slide-level", ">= 0"), (["--min-tissue", "2"], "--min-tissue", "<= 1")])
def test_infer_checks_its_flags_bounds(argv, option, detail):
    job = infer_cmd.parse_job([*SLIDE, *argv])
    with pytest.raises(ConfigError, match=re.escape(f"{option}: must be a number") + ".*" + re.escape(detail)):
        job.check_flags()


def test_infer_resume_is_resume_outputs_and_the_old_spelling_works_with_a_notice(capsys):
    job = infer_cmd.parse_job([*SLIDE, "--resume-outputs"])
    assert job.resume and capsys.readouterr().err == ""
    old = infer_cmd.parse_job([*SLIDE, "--resume"])
    assert old == job
    assert capsys.readouterr().err.strip() == renamed_notice("--resume", "--resume-outputs")
    keywords = dict(checkpoint="ck", slide="s.svs", output="m.npy")
    assert InferJob.from_keywords({**keywords, "resume_outputs": True}) == job
    assert InferJob.from_keywords({**keywords, "resume": True}) == job
    assert capsys.readouterr().err.strip() == renamed_notice("resume=", "resume_outputs=")
    assert "--resume-outputs" in infer_cmd.infer_parser().format_help()
    assert "--resume " not in infer_cmd.infer_parser().format_help()


def test_tune_json_is_save_json_and_the_old_spelling_works_with_a_notice(capsys):
    job = tune_job(tune_parser().parse_args([*TUNE, "--save-json", "t.json"]))
    assert job.save_json == "t.json" and capsys.readouterr().err == ""
    assert tune_job(tune_parser().parse_args([*TUNE, "--json", "t.json"])) == job
    assert capsys.readouterr().err.strip() == renamed_notice("--json", "--save-json")
    assert build_job(TuneJob, {"memory_limit_mb": 100.0, "json": "t.json"}, "tune") == job
    assert capsys.readouterr().err.strip() == renamed_notice("json=", "save_json=")
    both = build_job(TuneJob, {"memory_limit_mb": 100.0, "json": "old.json", "save_json": "t.json"}, "tune")
    assert both == job                                       # the new spelling's value wins


def test_tune_takes_the_bounds_train_gives_the_shared_options():
    for flag, value in (("--batch-size", "0"), ("--image-size", "0"), ("--num-layers", "0"), ("--num-filters", "0"),
                        ("--num-classes", "0"), ("--steps", "0")):
        with pytest.raises(ConfigError, match=re.escape(f"{flag}: must be a number >= 1")):
            tune_job(tune_parser().parse_args([*TUNE, flag, value]))
    with pytest.raises(ConfigError, match="--image-size: tune plans square images"):
        tune_job(tune_parser().parse_args([*TUNE, "--image-size", "8,16,16"]))
