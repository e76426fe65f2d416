"""``--config FILE.toml`` (issue 65): the file's keys as the command's flags with the command line over them, every
command's parser taking it, bad keys and values refused with their line, and a job written as TOML giving the same
job back (the ``config.toml`` a training run leaves beside its checkpoints)."""
from __future__ import annotations

from pathlib import Path

import pytest

from mpi4dl_nb.cli.commands import COMMANDS, usage
from mpi4dl_nb.cli.job_flags import parsed_job
from mpi4dl_nb.cli.train_cmd import train_parser
from mpi4dl_nb.cli.tune_cmd import tune_job, tune_parser
from mpi4dl_nb.config_file import job_toml
from mpi4dl_nb.run.checkpoint_space import CONFIG_NAME, config_file_for, write_run_config
from mpi4dl_nb.run.job import TrainJob

# a job far from the defaults: every kind of flag (switches on and off, a repeated flag, a flag with a value it
# stands for alone, lists, choices, numbers, a volume-free image size)
FLAGS = """--model resnet --resnet-version 1 --num-layers 8 --num-filters 4 --image-size 32 --batch-size 4
--num-samples 16 --num-classes 3 --classes a,b,c --dtype float64 --steps 4 --seed 3 --split-size 2 --spatial-size 1
--num-spatial-parts 4 --slice-method vertical --balance 2,2 --parts 2 --schedule 1f1b --no-check-ops
--checkpoint-activations --precision bf16 --grad-bucket-mb none --optimizer adamw --lr 0.0125 --weight-decay 0.05
--lr-schedule cosine --warmup-steps 2 --augment rot90,flip --class-weights 1,2.5,3 --pool max --min-tissue 0.25
--skip-bad-files --val-fraction 0.25 --eval-every 2 --log-dir logs --keep-best val_loss --keep-checkpoints 3
--checkpoint-every 2 --checkpoint-dir ckpt --allow-config-change lr --allow-config-change seed,dtype
--on-nonfinite skip-step --no-progress -v --step-timeout 0.5 --release-heap-every 500 --backend gloo
--device cpu""".split()


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def refusal(capsys: pytest.CaptureFixture[str], parser_of, argv: list[str]) -> str:
    """The one line a refused ``argv`` prints (exit 2)."""
    with pytest.raises(SystemExit) as stop:
        parser_of().parse_args(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_the_file_gives_flags_and_the_command_line_replaces_them(tmp_path):
    """Keys with dashes or underscores in any case; the command's table over the top level; a flag on the command
    line (a repeated one's whole list, an abbreviation, ``--flag=value``) over the file; switches and a flag that
    stands alone for a value."""
    path = write(tmp_path, """
steps = 2
lr = 0.5
local_dp = 1          # --local-DP
Batch_Size = 8
[train]
lr = 0.25
no-progress = true
verbose = false
checkpoint-activations = true
allow-config-change = ["seed", "lr"]
classes = ["a", "b"]
""")
    args = vars(train_parser().parse_args(["--config", path]))
    assert args == {"steps": 2, "lr": 0.25, "local_dp": 1, "batch_size": 8, "progress": False,
                    "checkpoint_activations": "every", "allow_config_change": ["seed", "lr"], "classes": ("a", "b")}
    args = vars(train_parser().parse_args(["--allow-config-change", "dtype", f"--config={path}", "--lr=0.125",
                                           "--batch", "4", "--num-layers", "20"]))
    assert args["allow_config_change"] == ["dtype"] and args["lr"] == 0.125 and args["batch_size"] == 4
    assert args["num_layers"] == 20 and args["steps"] == 2 and args["progress"] is False


def test_written_job_gives_the_same_job_back(tmp_path):
    """``job_toml`` of a job far from the defaults, and of the defaults, read back through ``--config``: the same
    TrainJob, every flag written (none left as a comment)."""
    for argv in (FLAGS, []):
        job = parsed_job(train_parser().parse_args(argv), TrainJob, "train")
        text = job_toml(job, "train")
        assert "parses back" not in text, text
        again = parsed_job(train_parser().parse_args(["--config", write(tmp_path, text)]), TrainJob, "train")
        assert again == job


@pytest.mark.parametrize("text, expected", [
    ("steps = 2\nlr = 'fast'\n", "job.toml:2: lr: --lr 'fast': not a number"),
    ("steps = 2\n[train]\nnum-layer = 8\n", "job.toml:3: num-layer: is not a flag of train (keys are long flag "
                                            "names without the dashes); did you mean num-layers"),
    ("stpes = 2\n", "job.toml:1: stpes: is no command's flag (keys are long flag names without the dashes); did you "
                    "mean steps"),
    ("[trian]\nsteps = 2\n", "job.toml:1: [trian] is no command's table"),
    ("\n[train]\nmemory-limit-mb = 100\n", "job.toml:3: memory-limit-mb: is not a flag of train but of tune"),
    ("no-progress = 1\n", "job.toml:1: no-progress: --no-progress is a switch: true (give it) or false"),
    ("lr = true\n", "job.toml:1: lr: --lr takes a value, not true"),
    ("slice-method = 'diag'\n", "job.toml:1: slice-method: --slice-method 'diag': choose one of square"),
    ("steps = [1, [2]]\n", "job.toml:1: steps: --steps takes text or a number"),
    ("steps = 2\nsteps = 3\n", "job.toml: not TOML"),
    ("config = 'other.toml'\n", "job.toml:1: config: a configuration file cannot name another"),
])
def test_a_bad_key_or_value_is_refused_naming_its_line(tmp_path, capsys, text, expected):
    path = write(tmp_path, text)
    line = refusal(capsys, train_parser, ["--config", path, "--lr", "0.1"])    # a value the command line replaces too
    assert line.startswith(f"python -m mpi4dl_nb train: error: --config: {tmp_path / expected}"), line


def test_config_given_twice_or_missing_is_refused(tmp_path, capsys):
    path = write(tmp_path, "steps = 2\n")
    assert "--config: given twice" in refusal(capsys, train_parser, ["--config", path, "--config", path])
    assert "no such file" in refusal(capsys, train_parser, ["--config", str(tmp_path / "none.toml")])
    assert "needs a file" in refusal(capsys, train_parser, ["--config"])


def test_a_top_level_key_of_another_command_is_left_to_it(tmp_path):
    """``memory-limit-mb`` (tune's, required there) and ``steps`` at the top level: train takes steps only; tune
    takes both (its required flag from the file)."""
    path = write(tmp_path, "memory-limit-mb = 100\nsteps = 3\n")
    assert vars(train_parser().parse_args(["--config", path])) == {"steps": 3}
    job = tune_job(tune_parser().parse_args(["--config", path]))
    assert job.memory_limit_mb == 100 and job.steps == 3


def test_a_former_spelling_on_the_command_line_replaces_the_files_flag(tmp_path, capsys):
    path = write(tmp_path, "memory-limit-mb = 100\nsave-json = 'file.json'\n")
    assert tune_job(tune_parser().parse_args(["--config", path])).save_json == "file.json"
    assert tune_job(tune_parser().parse_args(["--config", path, "--json", "cli.json"])).save_json == "cli.json"
    assert "--json is now --save-json" in capsys.readouterr().err


def test_a_key_of_another_command_s_table_this_command_takes_is_never_dropped(tmp_path, capsys):
    """Issue 91: ``lora-rank = 4`` under [infer] read by train (which takes it; infer does not) exits 2 naming the key
    and the table, as does a key two commands take set in the other's table only; given for train too (its table,
    the top level, the command line), the other table's value is the other command's."""
    path = write(tmp_path, "steps = 1\n[infer]\nlora-rank = 4\n")
    line = refusal(capsys, train_parser, ["--config", path])
    assert line == (f"python -m mpi4dl_nb train: error: --config: {path}:3: lora-rank: is in [infer], a table train "
                    f"does not read, but train takes it too: move it to the top level (every command's) or to "
                    f"[train], or set it for train there as well")
    shared = write(tmp_path, "[tune]\nmemory-limit-mb = 10\nsteps = 5\n", "shared.toml")
    assert "steps: is in [tune], a table train does not read" in refusal(capsys, train_parser, ["--config", shared])
    assert tune_job(tune_parser().parse_args(["--config", shared])).steps == 5
    assert vars(train_parser().parse_args(["--config", path, "--lora-rank", "8"])) == {"steps": 1, "lora_rank": 8}
    for own in ("lora-rank = 2\nsteps = 1\n[infer]\nlora-rank = 4\n",
                "[train]\nlora-rank = 2\n[infer]\nlora-rank = 4\n"):
        assert vars(train_parser().parse_args(["--config", write(tmp_path, own, "own.toml")]))["lora_rank"] == 2


@pytest.mark.parametrize("command, table, taken", [
    ("layout", "json = true", {"json": True}),
    ("train", "steps = 3", {"steps": 3}),
    ("evaluate", "checkpoint = 'ck'", {"checkpoint": "ck"}),
    ("infer", "checkpoint = 'ck'\noutput = ['a.npy', 'b.csv']", {"checkpoint": "ck", "output": ["a.npy", "b.csv"]}),
    ("tune", "memory-limit-mb = 10", {"memory_limit_mb": 10.0}),
    ("export", "checkpoint = 'ck'\noutput-file = 'm.pt'", {"checkpoint": "ck", "output_file": "m.pt"}),
])
def test_every_command_takes_its_table(tmp_path, command, table, taken):
    """Each command reads its own table (the others' tables left to them) and lists --config in its help."""
    others = "".join(f"[{c.name}]\nunknown-to-all = 1\n" for c in COMMANDS if c.name != command)
    path = write(tmp_path, f"[{command}]\n{table}\n{others}")
    parser = next(c for c in COMMANDS if c.name == command).parser()
    assert vars(parser.parse_args(["--config", path])) == taken
    assert "--config FILE.toml" in parser.format_help()
    assert f"  {command} " in usage()


def test_config_toml_is_never_written_over_another_runs(tmp_path, capsys):
    """config.toml when absent or the same; another run's other flags: config-<run_id>.toml (then -2), said once;
    only rank 0 writes, and only with a checkpoint directory."""
    assert config_file_for(tmp_path, "a", "r1") == tmp_path / CONFIG_NAME
    (tmp_path / CONFIG_NAME).write_text("a")
    assert config_file_for(tmp_path, "a", "r1") == tmp_path / CONFIG_NAME
    assert config_file_for(tmp_path, "b", "r1") == tmp_path / "config-r1.toml"
    (tmp_path / "config-r1.toml").write_text("c")
    assert config_file_for(tmp_path, "b", "r1") == tmp_path / "config-r1-2.toml"
    folder = tmp_path / "ck"
    folder.mkdir()
    first = TrainJob.of(checkpoint_dir=str(folder), steps=1, num_samples=4).check()
    assert write_run_config(first, 1, "r1") is None and not list(folder.iterdir())
    assert write_run_config(TrainJob.of(steps=1).check(), 0, "r1") is None
    assert write_run_config(first, 0, "r1") == folder / CONFIG_NAME
    assert 'checkpoint-dir = "' in (folder / CONFIG_NAME).read_text() and not capsys.readouterr().err
    assert write_run_config(first, 0, "r2") == folder / CONFIG_NAME          # the same flags: the same file
    other = TrainJob.of(checkpoint_dir=str(folder), steps=1, num_samples=4, seed=1).check()
    written = write_run_config(other, 0, "r3")
    assert written == folder / "config-r3.toml" and "seed = 1" in written.read_text()
    assert "seed = 0" in (folder / CONFIG_NAME).read_text()
    assert f"this run's are in {written}" in capsys.readouterr().err
