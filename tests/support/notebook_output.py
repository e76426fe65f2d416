"""What notebooks 04, 06, 08, 09, 10, 11, 12 and 13 must print, checked alike after a headless run and a JupyterLab
Run All."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def check_printed_output(number: str, text: str, kernel_tmpdir: Path) -> None:
    """Assert notebook ``number``'s printed ``text``; ``kernel_tmpdir`` is the TMPDIR its kernel ran with."""
    if number == "04":
        assert "-> exact: True" in text
        line = next(item for item in text.splitlines() if item.startswith("MPI4DL_SUMMARY "))
        summary = json.loads(line.split(" ", 1)[1])
        assert summary["exact"] and summary["world_size"] == 5
        assert summary["serial_images_per_second"] > 0
        assert max(summary["memory_measured_mb"]) <= 0.6 * summary["serial_memory_mb"]
        # it learns: the held-out accuracy ends above chance and above its first evaluation (what `make demo` prints)
        accuracy, chance = summary["held_out_accuracy"], summary["chance_accuracy"]
        assert len(accuracy) == len(summary["held_out_steps"]) >= 2 and chance >= 0.5
        assert accuracy[-1] > max(chance, accuracy[0]), f"held-out accuracy {accuracy} (chance {chance})"
        assert summary["held_out_images"] == 8 * summary["held_out_crops"] > 0
        assert "-> learns (above chance 0.50 and above the first evaluation): True" in text
        # the exercise: each variant trained and compared with its own micro-batched serial reference
        assert "{'parts': 2}" in text and "{'times': 1}" in text and "{'balance': (2, 3)}" in text
        assert not list(kernel_tmpdir.glob("mpi4dl-04-curves-*")), "the learning-curve logs were left behind"
    if number == "06":   # commands shown as run, with their return code; the rank table
        launcher = (Path(sys.executable).parent / "mpiexec").resolve()       # the kernel is this venv's python
        shown = re.findall(r"^\$ (\S+) -n 3 ", text, re.M)                   # (a venv reached through a link: the
        assert shown and all(Path(path).resolve() == launcher for path in shown), shown    # same file either way)
        assert "rank  replica  stage" in text and text.count("--- return code 0 ---") == 3
        assert "LayerNorm: ConfigError" in text and "EngineTimeout" in text and "after restart" in text
    if number == "08":   # the classifier replaced; both models exact per layer and over an SP+LP step
        assert "the classifier fc has 1000 outputs in the file and 2 here" in text
        assert text.count("-> exact: True") == 2 and "refused" not in text
        assert "<All keys matched successfully>" in text
        assert not list(kernel_tmpdir.glob("mpi4dl-08-*")), "the saved weights were left behind"
    if number == "09":   # 4 tiles equal one process; QuPath-ready polygons of the DAB class; the scratch folder gone
        assert "-> exact: True" in text and "exact: False" not in text
        assert "FeatureCollection with " in text and "classes: ['DAB']" in text
        assert not list(kernel_tmpdir.glob("mpi4dl-09-*")), "the notebook's temporary folder was left behind"
    if number == "10":   # whole slides on 4 tiles + 1 equal one process with margin; the recipe learns; cleaned up
        assert "-> exact: True" in text and "exact: False" not in text
        learned = re.search(r"held-out loss (\S+) -> (\S+) \(chance", text)
        assert learned and float(learned.group(2)) < min(0.35, float(learned.group(1)) / 2), "the recipe did not learn"
        differences = re.search(r"max \|loss difference\| = (\S+), max \|weight difference\| = (\S+) over", text)
        assert differences and max(float(v) for v in differences.groups()) < 1e-11, "the exactness margin shrank"
        auc = re.search(r"slide-level AUC in one process: (\S+)", text)
        assert auc and float(auc.group(1)) > 0.5, "the model did not learn to rank the held-out slides"
        assert f"slide-level AUC on 4 tiles + 1 rank: {auc.group(1)} over 6 slides" in text
        held = re.findall(r"(negative|positive)\s+P\(positive\) = (\S+)", text)
        assert len(held) == 6, held
        assert (min(float(p) for label, p in held if label == "positive")
                > max(float(p) for label, p in held if label == "negative")), f"classes not separated: {held}"
        looked = re.search(r"(\d+)% of the cells lie near a dot and hold (\d+)% of the features' maxima", text)
        assert looked and int(looked.group(2)) > 2 * int(looked.group(1)), "the maxima do not fall on the dots"
        assert not list(kernel_tmpdir.glob("mpi4dl-10-*")), "the notebook's temporary folder was left behind"
    if number == "11":   # the 3-D U-Net on 2x2x2 tiles equals one process; it finds the cells; the halo counted
        assert "-> exact: True" in text and "exact: False" not in text
        differences = re.search(r"max \|loss difference\| = (\S+), max \|weight difference\| = (\S+) over", text)
        assert differences and max(float(v) for v in differences.groups()) < 1e-9
        assert "tiles (depth, row, col) by rank: [(0, 0, 0), (0, 0, 1)" in text
        dice = [float(v) for v in re.findall(r"Dice of the cell class over all 4096 voxels = (\S+)", text)]
        assert len(dice) == 2 and min(dice) > 0.5, f"the U-Net did not find the cells: Dice {dice}"
        assert "tile 0: receives 217 voxels" in text and "tile 7: receives 217 voxels" in text
    if number == "12":
        check_vision_transformers(text)
    if number == "13":
        check_fine_tuning(text, kernel_tmpdir)


def check_vision_transformers(text: str) -> None:
    """Notebook 12: a timm ViT on 2x2 token tiles equals one process; memory per rank; the ring's steps and bytes;
    the planner's largest images of foundation models."""
    assert "-> exact: True" in text and "exact: False" not in text
    errors = re.search(r"max relative difference: output (\S+), gradients (\S+) over", text)
    assert errors and max(float(v) for v in errors.groups()) < 1e-10
    assert "tokens per rank: (65, 64, 64, 64)" in text
    assert "step 3: rank 3 computes with the 65 keys of rank 0" in text
    shares = [float(v) for v in re.findall(r"= (\S+) of one process", text)]
    assert len(shares) == 3 and shares[-1] < 0.5, f"the largest rank's share of one process: {shares}"
    assert "rank 0 sends 296448 bytes forward, 591360 backward" in text
    # what fits where at 1024 px: ViT-g/14's weights and AdamW alone pass 16 GB on one rank; ZeRO 3 on 4 tiles fits
    fits = re.findall(r"^(ViT-\S+) .* P = (\d): peak GB ZeRO 0 ([\d.]+).*\n\s+first that fits: 16 GB: ([^,]+), "
                      r"40 GB: ([^,]+), 80 GB: (.+)$", text, re.M)
    first = {(model, int(parts)): sixteen for model, parts, _, sixteen, _, _ in fits}
    assert len(fits) == 6 and first["ViT-g/14", 1] == "none" and first["ViT-g/14", 4] == "ZeRO 3", fits
    peaks = {(model, int(parts)): float(peak) for model, parts, peak, *_ in fits}
    assert all(peaks[m, 4] < peaks[m, 2] < peaks[m, 1] for m in ("ViT-H/14", "ViT-g/14")), peaks


def check_fine_tuning(text: str, kernel_tmpdir: Path) -> None:
    """Notebook 13: UNI's preset cut to 2 blocks, from a headless file, fine-tuned with LoRA and layer decay on 4 tiles
    + a layer rank, equals one process; only adapters, final norm and head moved; the logged rate of each group is
    BEiT's rule times the schedule; the merged export loads strictly into timm and gives the run's logits; the
    planner's largest images of the whole UNI; the notebook's folder removed."""
    assert "-> exact: True" in text and "exact: False" not in text
    differences = re.search(r"max \|loss difference\| = (\S+), max \|weight difference\| = (\S+) over", text)
    assert differences and max(float(v) for v in differences.groups()) < 1e-10
    assert "a head in it: False" in text and "no classifier in the file" in text
    assert "unchanged, moved: ['norm.weight', 'norm.bias']" in text, "a frozen weight moved, or the norm did not"
    rule = re.search(r"logged against lr x 0.75\^\(L-i\) x schedule: max difference (\S+)", text)
    assert rule and float(rule.group(1)) < 1e-15 and text.count("lr_scale") == 3
    assert "<All keys matched successfully>" in text and "-> the same network: True" in text
    fits = {(int(parts), kind): int(side.replace(",", "")) for parts, full, lora in re.findall(
        r"on (\d) ranks? of 24 GB: largest image ([\d,]+) px fully fine-tuned, ([\d,]+) px with LoRA", text)
        for kind, side in (("full", full), ("lora", lora))}
    assert len(fits) == 4 and all(fits[p, "full"] < fits[p, "lora"] for p in (1, 4)) and \
        all(fits[1, k] < fits[4, k] for k in ("full", "lora")), fits
    assert "training the adapters and the head (final norm, classifier): 3,149,826 parameters" in text
    assert not list(kernel_tmpdir.glob("mpi4dl-13-*")), "the notebook's temporary folder was left behind"
