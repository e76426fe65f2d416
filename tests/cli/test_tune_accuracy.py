"""``tune`` on 2 ranks with a small Swin and a small ViT (issue 81): every row's predicted/measured step time between
0.8 and 1.25, the one-process reference's included.

Marked ``alone``: ``make test`` runs it after both of its streams, with the machine to itself. The planner predicts
what a job takes with its ranks on cores of their own; beside the suite's other stream (a pytest process, notebook
kernels, a browser) two ranks on this 2-core machine get a part of them, and a busy process beside them made the
measured steps 1.8-2.8x the predicted ones (05:44 UTC, 2026-11-29).

Even so a CI host has spells of its own: once the one-process row read 1.59 (a ViT; its layers, timed on two threads
by the wall clock, took 0.2 s in all, which a spell could cover; ``layer_timer.timed_rounds`` now spreads such
timings over a second). So a ``tune`` whose rows miss the band is run once more, and that run's rows must all be in
it; the failure names both runs' ratios.
"""

from __future__ import annotations

import json

import pytest

from tests.support.mpirun import run_mpi
from tests.support.requirements import MODELS_EXTRA, missing_modules, require_or_skip

LOW, HIGH = 0.8, 1.25      # predicted / measured
ATTEMPTS = 2
MODELS = {
    "swin": ("--model", "timm:swin_tiny_patch4_window7_224", "--model-args",
             "depths=(2,2,1,1),embed_dim=16,num_heads=(1,1,2,2),window_size=7,drop_path_rate=0"),
    "vit": ("--model", "timm:vit_tiny_patch16_224", "--model-args", "depth=2"),
}


@pytest.mark.mpi
@pytest.mark.alone
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tune_predicts_every_row_of_a_small_transformer_within_25_percent(name, tmp_path):
    require_or_skip(missing_modules("timm"), "tune on transformers", MODELS_EXTRA)
    runs: list[dict[str, float]] = []
    for attempt in range(ATTEMPTS):
        path = tmp_path / f"tune-{attempt}.json"
        run_mpi(2, "mpi4dl_nb", "tune", *MODELS[name], "--image-size", "224", "--batch-size", "4", "--num-classes",
                "2", "--memory-limit-mb", "2000", "--top", "2", "--save-json", path, module=True, timeout=300)
        rows = json.loads(path.read_text())["rows"]
        ratios = {row["label"]: row["predicted_seconds"] / row["measured_seconds"] for row in rows}
        assert len(ratios) == 3 and "one process" in ratios, ratios      # the reference and two configurations
        runs.append(ratios)
        if all(LOW <= ratio <= HIGH for ratio in ratios.values()):
            break
    assert all(LOW <= ratio <= HIGH for ratio in runs[-1].values()), runs
