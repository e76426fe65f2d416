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
