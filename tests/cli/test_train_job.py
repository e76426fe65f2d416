"""The job seam: one TrainJob and one EvaluateJob from a command's flags or from Python keyword arguments (the same
job, plan and checkpoint record); no function of cli/ assigns to a parsed Namespace, none outside cli/ takes one,
no argparse internals in the package; ``val_loss`` is the run's loss."""
from __future__ import annotations

import argparse
import ast
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

import mpi4dl_nb as dl
from mpi4dl_nb.cli import evaluate_cmd
from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.cli.job_flags import keyword_values
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.evaluate_job import EvaluateJob
from mpi4dl_nb.run.job import TrainJob
from tests.support.bad_data import write_tiles
from tests.support.summary import json_record

PACKAGE = Path(dl.__file__).parent
FLAGS = ("--model resnet --resnet-version 1 --num-layers 8 --num-filters 4 --image-size 32 --batch-size 4 "
         "--num-samples 16 --num-classes 3 --classes a,b,c --dtype float64 --steps 4 --seed 3 --split-size 2 "
         "--spatial-size 1 --num-spatial-parts 4 --slice-method vertical --balance 2,2 --parts 2 --schedule 1f1b "
         "--no-check-ops --checkpoint-activations --precision bf16 --grad-bucket-mb none --optimizer adamw --lr 0.01 "
         "--weight-decay 0.05 --lr-schedule cosine --warmup-steps 2 --augment flip,rot90 --class-weights 1,2,3 "
         "--pool max --min-tissue 0.25 --skip-bad-files --val-fraction 0.25 --eval-every 2 --log-dir logs "
         "--keep-best val_loss --keep-checkpoints 3 --checkpoint-every 2 --checkpoint-dir ckpt --resume latest "
         "--allow-config-change lr --allow-config-change seed,dtype --on-nonfinite skip-step --no-progress -v "
         "--step-timeout 0 --release-heap-every 500 --backend gloo --device cpu").split()
KEYWORDS: dict[str, object] = dict(
    model="resnet", resnet_version=1, num_layers=8, num_filters=4, image_size=32, batch_size=4, num_samples=16,
    num_classes=3, classes="a,b,c", dtype="float64", steps=4, seed=3, split_size=2, spatial_size=1,
    num_spatial_parts=4, slice_method="vertical", balance=(2, 2), parts=2, schedule="1f1b", check_ops=False,
    checkpoint_activations="every", precision="bf16", grad_bucket_mb=None, optimizer="adamw", lr=0.01,
    weight_decay=0.05, lr_schedule="cosine", warmup_steps=2, augment="flip,rot90", class_weights="1,2,3", pool="max",
    min_tissue=0.25, skip_bad_files=True, val_fraction=0.25, eval_every=2, log_dir=Path("logs"),
    keep_best="val_loss", keep_checkpoints=3, checkpoint_every=2, checkpoint_dir=Path("ckpt"), resume="latest",
    allow_config_change=["lr", "seed,dtype"], on_nonfinite="skip-step", progress=False, verbose=True,
    step_timeout=0, release_heap_every=500, backend="gloo", device="cpu")


def flags_job(argv: list[str]) -> TrainJob:
    """The job ``train`` builds from ``argv`` (before its check)."""
    return TrainJob.of(**keyword_values(cli.train_parser().parse_args(argv), TrainJob))


def test_the_same_train_job_plan_and_record_from_flags_and_from_keywords(monkeypatch):
    from_flags, from_keywords = flags_job(FLAGS), TrainJob.of(**KEYWORDS)
    assert from_flags == from_keywords
    monkeypatch.setattr("mpi4dl_nb.cli.layout_cmd.launched_world", lambda: (0, 5, True))
    # --resume latest into ckpt/, which this test does not write (the source's check: tests/cli/test_user_messages.py)
    monkeypatch.setattr("mpi4dl_nb.run.job_check.check_resume_source", lambda resume, checkpoint_dir: None)
    plan = cli.parsed_plan(FLAGS)                     # parsed, checked and laid out for the 5 ranks it asks for
    assert plan == from_keywords.check() and plan.record() == from_keywords.check().record()
    assert plan.training.class_weights == (1.0, 2.0, 3.0) and plan.data.class_names == ("a", "b", "c")
    assert plan.config.balance == (2, 2) and plan.config.grid_shape == (1, 4) and plan.config.grad_bucket_mb is None
    assert plan.checkpoints.allowed_changes == {"lr", "seed", "dtype"} and plan.options.verbose
    assert plan.options.release_heap_every == 500 and TrainJob().options.release_heap_every == 1000
    assert plan.model.pool == "max" and plan.training.optimizer.spec.weight_decay == 0.05
    assert TrainJob.of(**{**KEYWORDS, "lr": 0.02}) != from_flags      # a keyword is not ignored
    assert flags_job([]) == TrainJob.of() == TrainJob()              # the defaults: the fields'


def test_the_same_evaluate_job_from_flags_and_from_keywords():
    argv = ("--checkpoint ck --checkpoint-select best --split-size 2 --spatial-size 1 --num-spatial-parts 2 "
            "--slice-method horizontal --model resnet --num-layers 8 --num-filters 4 --resnet-version 1 "
            "--num-classes 2 --app 1 --datapath tiles --image-size 32 --num-samples 8 --slide-level 1 "
            "--min-tissue 0.3 --val-fraction 0.25 --group-by (.+)_x --seed 2 --dtype float64 --batch-size 4 "
            "--task classification --aggregate top-3 --slide-csv s.csv --no-stain-normalize --backend mpi "
            "--device cpu --all-data -v --num-epochs 3").split()
    keywords: dict[str, object] = dict(
        checkpoint=Path("ck"), checkpoint_select="best", split_size=2, spatial_size=1, num_spatial_parts=2,
        slice_method="horizontal", model="resnet", num_layers=8, num_filters=4, resnet_version=1, num_classes=2,
        app="medical", datapath="tiles", image_size=32, num_samples=8, slide_level=1, min_tissue=0.3,
        val_fraction=0.25, group_by="(.+)_x", seed=2, dtype="float64", batch_size=4, task="classification",
        aggregate="top-3", slide_csv="s.csv", stain_normalize=False, backend="mpi", device="cpu", all_data=True,
        verbose=True, num_epochs=3)
    from_flags = EvaluateJob.of(**keyword_values(evaluate_cmd.evaluate_parser().parse_args(argv), EvaluateJob))
    assert from_flags == EvaluateJob.of(**keywords)
    assert from_flags.source.checkpoint == "ck" and from_flags.aggregate.describe() == "top-3"
    assert from_flags.app == "medical" and from_flags.config.grid_shape == (2, 1) and not from_flags.stain_normalize
    assert EvaluateJob.of(**{**keywords, "seed": 3}) != from_flags


def test_keywords_are_checked_like_flags():
    with pytest.raises(ConfigError, match="num_layer: is not a setting of train; did you mean num_layers"):
        TrainJob.of(num_layer=8)
    with pytest.raises(ConfigError, match="optimizer: 'adam': choose one of sgd, adamw"):
        TrainJob.of(optimizer="adam")
    with pytest.raises(ConfigError, match="--val-fraction"):
        TrainJob.of(val_fraction=1.5)
    with pytest.raises(ConfigError, match="--checkpoint: is required"):
        EvaluateJob.of(app="medical")


NAMESPACE_MAKERS = ("parse_args", "parse_known_args")
MUTATORS = ("pop", "update", "setdefault", "clear", "popitem", "__setitem__", "__delitem__")


def namespace_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names in ``function`` that hold a parsed Namespace (or ``vars`` of one): parameters annotated Namespace,
    names bound to ``parse_args(...)``, ``parse_known_args(...)[0]`` or ``vars(<such a name>)``."""
    arguments = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    found = {a.arg for a in arguments if a.annotation is not None and "Namespace" in ast.unparse(a.annotation)}
    for node in [*ast.walk(function)] * 2:           # twice: a name bound from another found later in the walk
        if isinstance(node, ast.Assign):
            value = node.value.value if isinstance(node.value, ast.Subscript) else node.value
            if isinstance(value, ast.Call) and parses(value, found):
                found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                found |= {t.elts[0].id for t in node.targets if isinstance(t, ast.Tuple) and t.elts
                          and isinstance(t.elts[0], ast.Name)}
    return found


def parses(call: ast.Call, names: set[str]) -> bool:
    """Whether ``call`` parses flags, or is ``vars`` of a Namespace (its own dictionary, not a copy)."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in NAMESPACE_MAKERS:
        return True
    if not (isinstance(func, ast.Name) and func.id == "vars" and call.args):
        return False
    given = call.args[0]
    return (isinstance(given, ast.Name) and given.id in names) or (isinstance(given, ast.Call) and parses(given, names))


def writes(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` assigns to (or deletes from) one of ``names``: ``args.x = ...``, ``args.x += ...``,
    ``setattr(args, ...)``, ``vars(args)[k] = ...``, ``d.pop(...)`` of such a dictionary."""
    def held(target: ast.AST) -> bool:
        if isinstance(target, ast.Attribute | ast.Subscript):
            base = target.value
            if isinstance(base, ast.Call):
                return parses(base, names)
            return isinstance(base, ast.Name) and base.id in names
        return False
    if isinstance(node, ast.Assign | ast.Delete):
        return any(held(t) for t in node.targets)
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return held(node.target)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            return isinstance(node.args[0], ast.Name) and node.args[0].id in names
        return isinstance(func, ast.Attribute) and func.attr in MUTATORS and held(func)
    return False


def test_no_function_in_cli_assigns_to_a_parsed_namespace():
    """Flags parse into typed values in one step: nothing in cli/ writes to the Namespace after parsing (nor sets
    defaults that only exist to be overwritten later)."""
    offenders = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        tree = ast.parse(path.read_text())
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            names = namespace_names(function)
            offenders += [f"{path.name}:{node.lineno} {function.name}" for node in ast.walk(function)
                          if writes(node, names) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                                     and node.func.attr == "set_defaults")]
    assert not offenders


def test_the_namespace_check_finds_what_it_looks_for():
    """The check above fails on each way of writing to a parsed Namespace (so it cannot pass by finding nothing)."""
    cases = ["args = parser.parse_args(argv)\n    args.app = 'medical'",
             "args, _ = parser.parse_known_args(argv)\n    setattr(args, 'x', 1)",
             "given = vars(parser.parse_args(argv))\n    given.pop('backend')",
             "vars(args)['x'] = 1", "args.num_classes += 1", "parser.set_defaults(cohort_data=None)"]
    for body in cases:
        function = ast.parse(f"def f(parser, argv, args: argparse.Namespace):\n    {body}\n").body[0]
        assert isinstance(function, ast.FunctionDef)
        names = namespace_names(function)
        assert any(writes(n, names) or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                                        and n.func.attr == "set_defaults") for n in ast.walk(function)), body
    safe = ast.parse("def f(parser, argv):\n    given = vars(parser.parse_args(argv)).copy()\n    given.pop('x')\n")
    function = safe.body[0]
    assert isinstance(function, ast.FunctionDef)
    assert not any(writes(n, namespace_names(function)) for n in ast.walk(function))


def test_no_function_outside_cli_takes_a_namespace():
    """No ``getattr(args, ...)`` in the package; no function outside cli/ takes an argparse Namespace."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "getattr(args" not in text, path
        if path.parent.name == "cli":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.annotation is not None and "Namespace" in ast.unparse(a.annotation) for a in arguments):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert not offenders
    assert not any(isinstance(value, argparse.Namespace) for value in vars(TrainJob.of()).values())


def test_no_argparse_internals_in_the_package():
    """``grep -rnE "_actions|argparse\\._" mpi4dl_nb`` finds nothing (the parser is generated from the jobs' fields,
    not read back through argparse's private names)."""
    pattern = re.compile(r"_actions|argparse\._")
    found = [f"{path.relative_to(PACKAGE)}:{number}" for path in sorted(PACKAGE.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), start=1) if pattern.search(line)]
    assert not found


def test_one_agreed_and_evaluate_independent_of_train():
    named = [f"{p.relative_to(PACKAGE)}" for p in PACKAGE.rglob("*.py")
             if any(isinstance(n, ast.FunctionDef) and n.name == "agreed" for n in ast.walk(ast.parse(p.read_text())))]
    assert "comm/agreement.py" in named and "cli/train_cmd.py" not in named, named
    imported = [n.module for n in ast.walk(ast.parse(Path(evaluate_cmd.__file__).read_text()))
                if isinstance(n, ast.ImportFrom)]
    assert not any(module and module.endswith("train_cmd") for module in imported), imported


def test_class_weighted_val_loss_is_the_same_from_training_and_from_evaluate(tmp_path, capsys):
    """One process, float64: the last evaluation of a run trained with --class-weights and ``evaluate`` of its
    final checkpoint report the same val_loss (1e-12), both named as the weighted cross-entropy."""
    write_tiles(tmp_path / "tiles", per_class=6, size=32)
    data = ["--app", "medical", "--datapath", str(tmp_path / "tiles"), "--num-classes", "2"]
    model = ["--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4",
             "--image-size", "32", "--dtype", "float64", "--split-size", "1", "--spatial-size", "0"]
    assert cli.main([*model, *data, "--batch-size", "4", "--steps", "2", "--val-fraction", "0.35",
                     "--class-weights", "0.5,3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress"]) == 0
    trained = json_record(capsys.readouterr().out)
    assert evaluate_cmd.main(["--checkpoint", str(tmp_path / "ckpt"), "--split-size", "1", "--spatial-size", "0",
                              *data]) == 0
    evaluated = json_record(capsys.readouterr().out, '{"checkpoint"')
    assert evaluated["step"] == trained["val_step"] == 2 and evaluated["count"] == trained["val_count"]
    assert abs(evaluated["loss"] - trained["val_loss"]) <= 1e-12 * max(1.0, abs(trained["val_loss"]))
    assert trained["val_loss_of"] == evaluated["loss_of"] == "cross-entropy, class weights 0.5,3"
    assert evaluated["config"]["slice_method"] is None and evaluated["config"]["num_spatial_parts"] == 1
    assert trained["config"]["slice_method"] is None and trained["config"]["num_spatial_parts"] == 1
    summary = dl.evaluate(tmp_path / "ckpt", app="medical", datapath=str(tmp_path / "tiles"), num_classes=2)
    assert summary is not None                        # dl.evaluate of keywords: the command's job and summary
    from_python = json.loads(summary.to_json())
    assert from_python.pop("seconds") > 0 and evaluated.pop("seconds") > 0 and from_python == evaluated


def test_a_job_is_frozen_and_grows_by_fields():
    job = TrainJob.of()
    with pytest.raises(AttributeError):
        job.data = replace(job.data)   # type: ignore[misc]
    assert replace(job, training=replace(job.training, seed=1)).training.seed == 1
    plan = job.check()
    assert replace(plan, training=replace(plan.training, seed=1)).training.seed == 1
