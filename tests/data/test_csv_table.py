"""data/csv_table.py: one reader (one delimiter rule) for every manifest: cohorts and a volume folder's
patients.csv."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpi4dl_nb.data.csv_table import header_delimiter, read_table
from mpi4dl_nb.data.manifest import read_cohort
from mpi4dl_nb.data.volume.groups import read_patients
from mpi4dl_nb.errors import ConfigError


def test_the_header_decides_the_delimiter():
    assert header_delimiter("slide,label") == "," and header_delimiter("slide;label;patient") == ";"
    assert header_delimiter("slide\tlabel") == "\t" and header_delimiter("volume") == ","
    assert header_delimiter("a;b;c,d") == ";"          # the most frequent, not the first found


def test_both_manifests_read_the_same_header_alike(tmp_path: Path):
    """A header whose most frequent delimiter is a semicolon (a comma inside a column name): both readers split
    on semicolons (patients.csv used to take the first delimiter found in the header, a comma)."""
    (tmp_path / "a.svs").write_bytes(b"II*\x00" + bytes(16))
    cohort = tmp_path / "cohort.csv"
    cohort.write_text("slide;label;stage, grade\na.svs;x;II\n")
    assert read_cohort(cohort).slides[0].meta() == {"stage, grade": "II"}
    patients = tmp_path / "patients.csv"
    patients.write_text("\ufeff# volumes\nvolume;patient;site, side\na.tif;p1;left\n\nb;p2;right\n")
    assert read_patients(patients) == {"a": "p1", "b": "p2"}
    table = read_table(patients, "--datapath", ("volume", "patient"), "")
    assert (table.header_line, table.delimiter, [r.line for r in table.rows]) == (2, ";", [3, 5])


def test_patients_csv_problems_name_their_line(tmp_path: Path):
    path = tmp_path / "patients.csv"
    for text, message in [("volume;patient\na.tif,p1\nb.tif,p2\n",
                           "the header (line 1) separates its columns with semicolons (;) but 2 rows (lines 2, 3) "
                           "with commas (,)"),
                          ("volume,who\na,p\n", "line 1: the header (volume, who) lacks the column patient; give "
                                                "the columns volume,patient (any order)"),
                          ("volume,patient\na,p\nb,\n", "line 3: a row needs a volume and a patient"),
                          ("volume,patient\na.tif,p\na.nii.gz,q\n", "line 3: volume 'a.nii.gz' is listed twice"),
                          ("# only\n\n", "is empty; it needs a header line with the columns volume,patient")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match="^--datapath: ") as caught:
            read_patients(path)
        assert message in str(caught.value), caught.value
