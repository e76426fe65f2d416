"""data/groups.py and data/barcodes.py: tile folders named by TCGA barcodes grouped by patient (``--group-by`` still
overrides, ``--group-by slide`` keeps slides), and a slide whose tiles lie in two class folders refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpi4dl_nb.data.barcodes import tcga_patient, tcga_patients
from mpi4dl_nb.data.groups import BY_SLIDE, GroupKind, groups_of
from mpi4dl_nb.data.pathology import TileFolderDataset
from mpi4dl_nb.errors import ConfigError

PATIENTS = ("TCGA-A1-A0SB", "TCGA-B6-A0RE")


def write_tiles(root: Path, names: dict[str, list[str]]) -> None:
    """8x8 PNG tiles ``root/<class>/<name>.png``."""
    from PIL import Image

    pixels = np.full((8, 8, 3), 128, dtype=np.uint8)
    for folder, stems in names.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for stem in stems:
            Image.fromarray(pixels).save(root / folder / f"{stem}.png")


def tcga_folder(root: Path) -> TileFolderDataset:
    """Two patients, two slides each (DX1 in neg/, DX2 in pos/: a patient's slides may differ in label), two tiles
    per slide."""
    write_tiles(root, {folder: [f"{patient}-01Z-00-{slide}.C1D2_{x}_0" for patient in PATIENTS for x in (0, 8)]
                       for folder, slide in (("neg", "DX1"), ("pos", "DX2"))})
    return TileFolderDataset(root, 8)


def test_a_tcga_barcode_names_its_patient():
    assert tcga_patient("TCGA-A1-A0SB-01Z-00-DX1.C1D2") == "TCGA-A1-A0SB"
    assert tcga_patient("TCGA-A1-A0SB") == "TCGA-A1-A0SB"
    assert tcga_patient("TCGA-A1-A0SBX-01Z") is None and tcga_patient("xTCGA-A1-A0SB-01Z") is None
    assert tcga_patients(["TCGA-A1-A0SB-01Z", "TCGA-A1-A0SB-11A"]) == ("TCGA-A1-A0SB",) * 2
    assert tcga_patients(["TCGA-A1-A0SB-01Z", "slide7"]) is None and tcga_patients([]) is None


def test_tcga_tiles_group_by_patient_and_group_by_overrides(tmp_path):
    dataset = tcga_folder(tmp_path)
    groups = groups_of(dataset)
    assert groups.kind is GroupKind.PATIENT and groups.heading == "grouped by patient (from TCGA barcodes)"
    assert sorted(set(groups.names)) == list(PATIENTS)
    assert len(set(groups.slides)) == 4 and all(s.endswith(("-DX1", "-DX2")) for s in groups.slides)
    for name, slide in zip(groups.names, groups.slides, strict=True):
        assert slide.startswith(name)                               # each slide's tiles under its own patient
    by_slide = groups_of(dataset, BY_SLIDE)
    assert by_slide.kind is GroupKind.SLIDE and by_slide.names == groups.slides
    assert by_slide.heading == "grouped by slide"
    by_regex = groups_of(dataset, r"(TCGA-[\w-]+)\..*")               # a regex names the slide: no patient step
    assert by_regex.kind is GroupKind.SLIDE and by_regex.names == groups.slides
    with pytest.raises(ConfigError, match="--group-by: slide 'TCGA-A1-A0SB' has tiles in"):
        groups_of(dataset, r"(TCGA-\w\w-\w{4})-.*")                  # a "slide" of both labels


def test_tiles_of_one_slide_in_two_class_folders_are_refused(tmp_path):
    write_tiles(tmp_path, {"neg": ["s0_0_0", "s0_8_0", "s1_0_0"], "pos": ["s0_0_8", "s2_0_0", "s1_8_8"]})
    dataset = TileFolderDataset(tmp_path, 8)
    with pytest.raises(ConfigError) as caught:
        groups_of(dataset)
    text = str(caught.value)
    assert text.startswith("--datapath: slide 's0' has tiles in ") and "(1 more slides so)" in text
    assert f"{tmp_path / 'neg'}/ and {tmp_path / 'pos'}/" in text and "rename the slide's tiles" in text
    with pytest.raises(ConfigError, match=r"^--group-by: slide 's'"):
        groups_of(dataset, r"(s)\d_.*")
    named = groups_of(dataset, r"(.+)")                                # a regex that keeps them apart is taken
    assert named.kind is GroupKind.SLIDE and len(set(named.names)) == 6


def test_a_cohort_split_says_where_its_patients_come_from(tmp_path):
    """A CLAM manifest's patients (``case_id``) and a manifest's TCGA slide names without a patient column: grouped by
    patient, the printed split naming the columns read as ours or the barcodes."""
    from mpi4dl_nb.data.cohort_slides import CohortSlides
    from mpi4dl_nb.data.manifest import read_cohort
    from tests.support.pyramid import write_pyramid

    names = ["TCGA-A1-A0SB-01Z-00-DX1", "TCGA-A1-A0SB-01Z-00-DX2", "TCGA-B6-A0RE-01Z-00-DX1"]
    for name in names:
        write_pyramid(tmp_path / f"{name}.tif", np.full((32, 32, 3), 150, dtype=np.uint8), levels=1, tile=16)
    clam = tmp_path / "clam.csv"
    clam.write_text("case_id,slide_id,label\n" + "".join(f"P{i // 2},{n},{'ab'[i % 2]}\n" for i, n in enumerate(names)))
    groups = groups_of(CohortSlides(read_cohort(clam), 32, min_tissue=0))
    assert groups.kind is GroupKind.PATIENT and groups.names == ("P0", "P0", "P1") and groups.slides == tuple(names)
    assert groups.heading == "grouped by patient (manifest columns: case_id -> patient, slide_id -> slide)"
    plain = tmp_path / "plain.csv"
    plain.write_text("slide,label\n" + "".join(f"{n}.tif,{'ab'[i % 2]}\n" for i, n in enumerate(names)))
    groups = groups_of(CohortSlides(read_cohort(plain), 32, min_tissue=0))
    assert groups.names == ("TCGA-A1-A0SB", "TCGA-A1-A0SB", "TCGA-B6-A0RE")
    assert groups.heading == "grouped by patient (from TCGA barcodes)"


def test_a_folder_mixing_tcga_barcodes_with_other_names_keeps_each_patient_on_one_side(tmp_path):
    """Issue 81 item 2: 6 TCGA patients of two slides each (12 slides) beside 4 slides of other names: the barcodes'
    tiles grouped by patient, the others by slide, said in one line; a split puts no patient on both sides."""
    from mpi4dl_nb.evaluation.grouped import split_grouped

    patients = [f"TCGA-A{i}-00{i}{i}" for i in range(6)]
    write_tiles(tmp_path, {folder: [f"{p}-01Z-00-{slide}_{x}_0" for p in patients for x in (0, 8)]
                           + [f"{other}_{x}_0" for other in others for x in (0, 8)]
                           for folder, slide, others in (("neg", "DX1", ("ihc1", "ihc2")),
                                                         ("pos", "DX2", ("ihc3", "ihc4")))})
    dataset = TileFolderDataset(tmp_path, 8)
    groups = groups_of(dataset)
    assert groups.kind is GroupKind.PATIENT
    assert groups.heading == "with 12 slides grouped by patient (TCGA barcodes), 4 by slide"
    assert sorted(set(groups.names)) == sorted([*patients, "ihc1", "ihc2", "ihc3", "ihc4"])
    labels = list(dataset.labels)
    for seed in range(4):
        split = split_grouped(labels, groups, 0.5, seed, 2)
        both = set(split.side_groups(split.train)) & set(split.side_groups(split.val))
        assert not both and split.val and split.train
        slides_held = {groups.slides[i] for i in split.val}
        assert any(s.startswith("TCGA") for s in slides_held) and any(s.startswith("ihc") for s in slides_held)
        train = [name for name in split.side_groups(split.train) if name.startswith("TCGA")]
        line = split.summary(labels, ["neg", "pos"]).splitlines()[1]
        assert line.startswith(f"  train: {len(train)} patients ({2 * len(train)} slides), "
                               f"{len(split.side_groups(split.train)) - len(train)} other slides, "), line
    assert groups_of(dataset, BY_SLIDE).kind is GroupKind.SLIDE                  # --group-by slide: slides apart


def test_tcga_tiles_beside_tiles_without_a_slide_name_still_group_by_patient(tmp_path):
    """Tiles whose names carry no slide (``img3.png``) beside TCGA tiles: those alone, the barcodes' by patient."""
    write_tiles(tmp_path, {"neg": [f"{PATIENTS[0]}-01Z-00-DX1_{x}_0" for x in (0, 8)] + ["img1", "img2"],
                           "pos": [f"{PATIENTS[0]}-01Z-00-DX2_{x}_0" for x in (0, 8)] + ["s9_0_0", "img3"]})
    groups = groups_of(TileFolderDataset(tmp_path, 8))
    assert groups.heading == ("with 2 slides grouped by patient (TCGA barcodes), 1 by slide, 3 images ungrouped (no "
                              "slide in their names)")
    assert groups.names.count(PATIENTS[0]) == 4 and len(set(groups.names)) == 5
    from mpi4dl_nb.evaluation.grouped import GroupedSplit

    everything = tuple(range(len(groups)))
    assert groups.side_parts(everything) == ["1 patients (2 slides)", "1 other slides", "3 images alone"]
    summary = GroupedSplit(groups, everything, ()).summary([0] * len(groups), ["neg"])
    assert summary.startswith("held-out split with 2 slides grouped by patient (TCGA barcodes), 1 by slide, 3 images")
