"""Leak-free held-out splits: whole slides (or patients) on one side, stratified by label as far as the groups
allow, seeded; data that cannot be grouped split image by image and said so."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from mpi4dl_nb.cli import train_cmd as cli
from mpi4dl_nb.data.groups import GroupKind, dataset_groups, group_pattern, groups_of_names, groups_of_slides
from mpi4dl_nb.errors import ConfigError
from mpi4dl_nb.evaluation.split import grouped_split
from mpi4dl_nb.run.python_run import split_dataset


def cohort(slides_per_class: int = 6, tiles: tuple[int, ...] = (3, 5, 8)) -> tuple[list[int], list[str]]:
    """Labels and slide keys of tiles: class c's slides hold 3, 5, 8, 3, ... tiles."""
    labels, groups = [], []
    for c in range(2):
        for s in range(slides_per_class):
            for _ in range(tiles[s % len(tiles)]):
                labels.append(c)
                groups.append(f"c{c}-slide{s}")
    return labels, groups


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("fraction", [0.2, 0.34, 0.5])
def test_no_slide_on_both_sides_and_each_class_near_its_share(seed, fraction):
    labels, groups = cohort()
    found = grouped_split(labels, groups, fraction, seed, num_classes=2)
    assert found is not None
    train, val = found
    assert sorted(train + val) == list(range(len(labels))) and not set(train) & set(val)
    assert not {groups[i] for i in train} & {groups[i] for i in val}       # the leak this split exists to stop
    for c in range(2):
        held = sum(1 for i in val if labels[i] == c)
        total = labels.count(c)
        assert 0 < held < total
        assert abs(held / total - fraction) <= 8 / total      # within one (largest) slide of the share
    assert grouped_split(labels, groups, fraction, seed, 2) == found    # seeded
    assert any(grouped_split(labels, groups, fraction, other, 2) != found for other in range(seed + 1, seed + 6))


def test_a_class_of_one_slide_cannot_be_split_by_slide():
    labels, groups = [0, 0, 0, 1, 1, 1, 1], ["a", "a", "b", "c", "c", "c", "c"]
    assert grouped_split(labels, groups, 0.3, 0, 2) is None


def test_file_names_say_their_slide_or_patient():
    slide_tiles = [Path(f"t/a/{s}_{x}_{y}.png") for s in ("S1", "S-2") for x, y in ((0, 0), (512, 1024))]
    found = groups_of_names(slide_tiles)
    assert found.kind is GroupKind.SLIDE and found.keys == ("S1", "S1", "S-2", "S-2")
    tcga = [Path("TCGA-AB-1234-01Z-00-DX1_x100_y200.png"), Path("tcga-ab-1234-01Z-00-DX2_x0_y0.png")]
    assert groups_of_names(tcga).keys == ("TCGA-AB-1234", "TCGA-AB-1234")       # two slides, one patient
    loose = groups_of_names([Path("tile0.png"), Path("tile1.png")])
    assert loose.kind is GroupKind.NONE and "tile0.png" in loose.describe() and "ungrouped" in loose.describe()
    mine = groups_of_names([Path("case7-scan2.png")], group_pattern(r"^(case\d+)"))
    assert mine.kind is GroupKind.PATTERN and mine.keys == ("case7",)
    assert groups_of_slides([0, 0, 1], [Path("x/one.svs"), Path("x/two.svs")]).keys == ("x/one.svs",) * 2 + (
        "x/two.svs",)


def test_group_by_is_checked_before_work():
    with pytest.raises(ConfigError, match="--group-by.*no group"):
        group_pattern("case")
    with pytest.raises(ConfigError, match="--group-by.*not a regular expression"):
        group_pattern("(")
    assert isinstance(group_pattern(r"(\w+)_"), re.Pattern)


def write_exported_tiles(root: Path, slides_per_class: int = 3, tiles_per_slide: int = 4, size: int = 32) -> None:
    """Tiles of 6 slides as a tiler exports them (``<class>/<slide>_<x>_<y>.png``), cut from the bundled image."""
    from PIL import Image

    from mpi4dl_nb.data import ihc_image

    source = ihc_image()
    for c, name in enumerate(("a", "b")):
        (root / name).mkdir(parents=True)
        for s in range(slides_per_class):
            for t in range(tiles_per_slide):
                y, x = 41 * (t + 5 * s) % 400, 67 * (t + 7 * c) % 400
                Image.fromarray(np.ascontiguousarray(source[y:y + size, x:x + size])).save(
                    root / name / f"{name}slide{s}_{x}_{y}.png")


def test_tile_folders_exported_from_slides_keep_each_slide_on_one_side(tmp_path, capsys):
    """``train --val-fraction`` on tiles of 6 slides: no slide on both sides, the split says so and is resumable
    (its identity names the held-out slides); ``dl.split_dataset`` gives the same split."""
    from mpi4dl_nb.data.pathology import TileFolderDataset

    write_exported_tiles(tmp_path / "tiles")
    dataset = TileFolderDataset(tmp_path / "tiles", 32)
    groups = dataset_groups(dataset)
    assert groups.kind is GroupKind.SLIDE and len(set(groups.keys or ())) == 6
    train, val = split_dataset(dataset, 0.34, seed=3)
    slide = {i: groups.keys[i] for i in range(len(dataset))} if groups.keys else {}
    assert not {slide[i] for i in train.indices} & {slide[i] for i in val.indices}
    assert {dataset.label(i) for i in val.indices} == {0, 1}
    flags = ["--app", "medical", "--datapath", str(tmp_path / "tiles"), "--num-classes", "2", "--model", "resnet",
             "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--image-size", "32",
             "--split-size", "1", "--spatial-size", "0", "--batch-size", "4", "--steps", "1", "--no-progress",
             "--val-fraction", "0.34", "--seed", "3"]
    assert cli.main(flags) == 0
    said = capsys.readouterr().err
    assert "held-out split: grouped by slide (6 slides): 2 held out, 4 trained on;" in said, said
    assert f"held out {len(val)} (" in said
    with pytest.raises(SystemExit) as refused:
        cli.main([*flags, "--group-by", "("])
    assert refused.value.code == 2 and "--group-by: '(' is not a regular expression" in capsys.readouterr().err


def test_data_from_no_slide_is_split_image_by_image_and_said_so(tmp_path, capsys):
    flags = ["--app", "synthetic", "--num-classes", "2", "--num-samples", "16", "--model", "resnet",
             "--resnet-version", "1", "--num-layers", "8", "--num-filters", "4", "--image-size", "16",
             "--split-size", "1", "--spatial-size", "0", "--batch-size", "4", "--steps", "1", "--no-progress",
             "--val-fraction", "0.25"]
    assert cli.main(flags) == 0
    assert "held-out split: ungrouped: images split one by one (SyntheticDataset images come from no slide)" in (
        capsys.readouterr().err)
