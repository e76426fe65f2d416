"""A foundation model's architecture from the command line (``--model-args``: SwiGLU-packed MLP, SiLU, register
tokens, LayerScale) on 4 tiles + a layer rank equals one process in float64, and so do ``--lora-rank 4`` (adapters
and head trained, the rest unchanged; recorded; merged by export) and ``--layer-decay 0.75`` (BEiT's groups on every
stage) (tests/mpi/foundation_exact.py)."""
from __future__ import annotations

from tests.support.battery import shared_job
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

JOB = shared_job(5, "foundation_exact", timeout=300)


def test_model_args_on_tiles_equal_one_process_and_are_recorded(shared_launch):
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    shared_launch(JOB).require(["model-args losses equal one process", "model-args recorded"])


def test_lora_on_tiles_equals_one_process_trains_adapters_only_and_merges(shared_launch):
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    shared_launch(JOB).require(["lora losses equal one process", "lora trains adapters and head only",
                                "lora recorded and merged"])


def test_layer_decay_on_tiles_equals_one_process_with_beit_groups(shared_launch):
    require_or_skip(missing_modules("timm"), "timm's vision transformers", MODELS_EXTRA)
    shared_launch(JOB).require(["layer decay groups are BEiT's", "layer decay losses equal one process",
                                "layer decay rates of every group logged"])
