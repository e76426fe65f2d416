"""Run identity: field-by-field comparison, allowed changes, and the refusal text."""
from __future__ import annotations

import pytest

from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.run.identity import RunIdentity, parse_allowed, refuse_changes

SAVED = RunIdentity({"model": "resnet [ab]", "image_size": 32, "batch_size": 4, "seed": 0, "app": "synthetic"})


def test_changes_are_compared_field_by_field():
    now = RunIdentity({**SAVED.fields, "image_size": 64, "seed": 1, "val_fraction": 0.1})
    assert [c.name for c in now.changes_from(SAVED)] == ["image_size", "seed"]   # new fields are no change
    assert [c.name for c in now.refused_changes(SAVED, {"seed"})] == ["image_size"]
    error = refuse_changes("checkpoint x", now.changes_from(SAVED))
    assert "image_size 32 -> 64 (--image-size)" in str(error) and "seed 0 -> 1 (--seed)" in str(error)
    assert "--allow-config-change image_size,seed" in str(error)


def test_allowed_names_accept_flag_spellings():
    assert parse_allowed(["--batch-size,seed", "image-size"]) == {"batch_size", "seed", "image_size"}
    assert "model" in parse_allowed(["all"]) and parse_allowed(None) == frozenset()
    with pytest.raises(ConfigError, match="unknown field.*colour"):
        parse_allowed(["colour"])


def test_a_changed_layer_decay_is_named_by_its_flag():
    from mpi4dl_nb.pipeline.optim import OptimizerSpec

    saved = RunIdentity({"optimizer": OptimizerSpec.of("adamw", 1e-3, layer_decay=0.75).describe()})
    now = RunIdentity({"optimizer": OptimizerSpec.of("adamw", 1e-3).describe()})
    error = str(refuse_changes("checkpoint x", now.changes_from(saved)))
    assert "layer decay 0.75' -> 'adamw lr 0.001, weight decay 0.01'" in error and "--layer-decay)" in error, error
    assert "--allow-config-change optimizer" in error
