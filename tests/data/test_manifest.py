"""data/manifest.py: the cohort manifest read and checked, every problem listed with its line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mpi4dl_nb.data.manifest import Side, read_cohort
from mpi4dl_nb.errors import ConfigError


def slides(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).write_bytes(b"II*\x00" + bytes(16))


def manifest(folder: Path, text: str, name: str = "cohort.csv") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_columns_paths_patients_and_metadata(tmp_path: Path) -> None:
    (tmp_path / "wsi").mkdir()
    slides(tmp_path / "wsi", "a.svs", "b.svs", "c.tif")
    path = manifest(tmp_path, "Slide,Label,patient,stage,fold\n"
                              "wsi/a.svs,tumour,P1,II,0\n"
                              "# a comment\n"
                              "\n"
                              f"{tmp_path / 'wsi' / 'b.svs'},normal,P1,I,0\n"
                              "wsi/c.tif,normal,,III,1\n")
    cohort = read_cohort(path)
    assert cohort.classes == ("normal", "tumour")
    assert [s.line for s in cohort] == [2, 5, 6]
    assert [s.path for s in cohort] == [tmp_path / "wsi" / n for n in ("a.svs", "b.svs", "c.tif")]
    assert cohort.labels == [1, 0, 0]
    assert list(cohort.patients) == ["P1", "c"]               # a slide without patient is its own patient
    assert cohort.slides[0].meta() == {"stage": "II"}
    assert [s.fold for s in cohort] == [0, 0, 1] and cohort.has_folds and not cohort.has_splits
    assert cohort.find(tmp_path / "wsi" / "c.tif") is cohort.slides[2]


def test_classes_given_keep_their_order_and_splits_parse(tmp_path: Path) -> None:
    slides(tmp_path, "a.svs", "b.svs")
    path = manifest(tmp_path, "slide;label;split\na.svs;b;Train\nb.svs;a; val \n")   # semicolons, any case
    cohort = read_cohort(path, classes=["b", "a"])
    assert cohort.classes == ("b", "a") and cohort.labels == [0, 1]
    assert [s.split for s in cohort] == [Side.TRAIN, Side.VAL]
    assert [s.name for s in cohort.on_side(Side.VAL)] == ["b"]


def test_every_problem_is_listed_with_its_line_at_once(tmp_path: Path) -> None:
    slides(tmp_path, *(f"s{i}.svs" for i in range(12)))
    rows = [f"s{i}.svs,{'pos' if i % 2 else 'neg'},P{i // 2},{i // 4}" for i in range(12)]
    rows[3] = "gone.svs,pos,P1,0"                     # line 5: missing file
    rows[6] = "s6.svs,maybe,P3,1"                     # line 8: unknown label
    rows[10] = "s10.svs,neg,P5,1"                     # line 12: P5 has folds 1 (s10) and 2 (s11)
    path = manifest(tmp_path, "slide,label,patient,fold\n" + "\n".join(rows) + "\n")
    with pytest.raises(ConfigError) as caught:
        read_cohort(path, classes=["neg", "pos"])
    text = str(caught.value)
    assert text.startswith("--cohort: ") and "3 problems" in text
    assert "line 5: slide" in text and "gone.svs: no such file" in text
    assert "line 8: label 'maybe' is not among --classes (neg, pos)" in text
    assert "patient 'P5' has slides with different fold values (line 12: 1, line 13: 2)" in text


def test_duplicates_bad_values_and_a_blank_beside_a_side(tmp_path: Path) -> None:
    slides(tmp_path, "a.svs", "b.svs")
    path = manifest(tmp_path, "slide,label,patient,split,fold\n"
                              "a.svs,x,P,train,\n"
                              "./a.svs,x,Q,,\n"
                              "b.svs,y,P,,zero\n"
                              "b.svs,y,R,holdout,\n")
    text = str(pytest.raises(ConfigError, read_cohort, path).value)
    assert "line 3: slide" in text and "is listed already on line 2" in text
    assert "line 4: fold 'zero' is not a whole number >= 0" in text
    assert "line 5: split 'holdout' is not one of train, val, test" in text


def test_a_patient_with_one_slide_placed_and_one_not_is_refused(tmp_path: Path) -> None:
    slides(tmp_path, "a.svs", "b.svs")
    path = manifest(tmp_path, "slide,label,patient,split\na.svs,x,P,train\nb.svs,x,P,\n")
    text = str(pytest.raises(ConfigError, read_cohort, path).value)
    assert "patient 'P' has slides with different split values (line 2: train, line 3: (none))" in text


def test_header_and_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        read_cohort(tmp_path / "none.csv")
    with pytest.raises(ConfigError, match="lacks the column label"):
        read_cohort(manifest(tmp_path, "slide,class\na.svs,x\n"))
    with pytest.raises(ConfigError, match="is empty"):
        read_cohort(manifest(tmp_path, "# nothing\n\n"))
    with pytest.raises(ConfigError, match="lists no slides"):
        read_cohort(manifest(tmp_path, "slide,label\n"))


def test_spreadsheet_exports_and_no_file_checks(tmp_path: Path) -> None:
    path = tmp_path / "c.tsv"
    path.write_bytes("\ufeffslide\tlabel\nfar/away.svs\tx\n".encode("utf-8"))
    cohort = read_cohort(path, probe=None)            # no file checks: the path is taken as written
    assert cohort.columns == ("slide", "label") and cohort.slides[0].path == tmp_path / "far" / "away.svs"


def test_many_problems_are_counted_after_the_first_twenty(tmp_path: Path) -> None:
    rows = "".join(f"m{i}.svs,x\n" for i in range(25))
    text = str(pytest.raises(ConfigError, read_cohort, manifest(tmp_path, "slide,label\n" + rows)).value)
    assert "25 problems" in text and "... and 5 more" in text and text.count("no such file") == 20


def test_a_header_and_rows_with_different_delimiters_are_refused_once(tmp_path: Path) -> None:
    """A header saved with semicolons above rows with commas: one message naming both and the rows' lines, not a
    "no label" per row."""
    slides(tmp_path, *(f"s{i}.svs" for i in range(10)))
    rows = "".join(f"s{i}.svs,{'pos' if i % 2 else 'neg'}\n" for i in range(10))
    text = str(pytest.raises(ConfigError, read_cohort, manifest(tmp_path, "# cohort\nslide;label\n" + rows)).value)
    assert text.startswith("--cohort: ") and "no label" not in text
    assert ("the header (line 2) separates its columns with semicolons (;) but 10 rows (lines 3, 4, 5, 6, 7, ...) "
            "with commas (,); use one delimiter on every line") in text
    # a row with the header's delimiter is read as before: a row missing its label is still named alone
    text = str(pytest.raises(ConfigError, read_cohort, manifest(tmp_path, "slide,label\ns0.svs,neg\ns1.svs\n")).value)
    assert "line 3: no label" in text and "delimiter" not in text


def test_every_class_given_must_label_a_slide_when_training(tmp_path: Path) -> None:
    """``--classes normal,tumour,other`` with no slide labelled ``other`` would train a 3-class model: refused as a
    missing class folder is, naming the class and the fix; evaluating a subset (every_class off) still reads."""
    slides(tmp_path, "a.svs", "b.svs")
    path = manifest(tmp_path, "slide,label\na.svs,normal\nb.svs,tumour\n")
    with pytest.raises(ConfigError) as caught:
        read_cohort(path, classes=["normal", "tumour", "other"], every_class=True)
    assert str(caught.value) == (f"--classes: other: no slide of {path} is labelled so (its labels: normal, tumour); "
                                 f"drop it (--classes normal,tumour) or label slides other in the manifest")
    assert read_cohort(path, classes=["normal", "tumour", "other"]).classes == ("normal", "tumour", "other")
    assert read_cohort(path, classes=["tumour", "normal"], every_class=True).labels == [1, 0]


def test_clam_columns_and_slide_names_without_extension_read_as_ours(tmp_path: Path) -> None:
    """CLAM's ``case_id,slide_id,label`` (slide_id: the name without its extension, found by it) parses as
    ``patient,slide,label`` would, and says how; a name two files fit is refused naming both."""
    slides(tmp_path, "s1.svs", "s2.svs", "s3.tif")
    ours = read_cohort(manifest(tmp_path, "patient,slide,label\nP1,s1.svs,neg\nP1,s2.svs,pos\nP2,s3.tif,neg\n"))
    clam = read_cohort(manifest(tmp_path, "case_id,slide_id,label,site\nP1,s1,neg,A\nP1,s2,pos,B\nP2,s3,neg,C\n",
                                "clam.csv"))
    assert clam.slides == tuple(replace(s, metadata=(("site", m),)) for s, m in zip(ours, "ABC", strict=True))
    assert clam.classes == ours.classes and clam.patients.keys() == ours.patients.keys()
    assert clam.grouping == "manifest columns: case_id -> patient, slide_id -> slide" and ours.grouping == ""
    both = read_cohort(manifest(tmp_path, "slide,slide_id,label\ns1.svs,x,neg\n", "both.csv"))
    assert both.slides[0].meta() == {"slide_id": "x"}                    # our own column wins; the alias is metadata
    slides(tmp_path, "s1.tif")
    text = str(pytest.raises(ConfigError, read_cohort, manifest(tmp_path, "slide,label\ns1,neg\n", "two.csv")).value)
    assert "line 2: slide" in text and "s1.svs and s1.tif both are; name the one it is" in text


def test_tcga_slide_names_without_a_patient_column_group_by_patient(tmp_path: Path) -> None:
    names = ["TCGA-A1-A0SB-01Z-00-DX1.svs", "TCGA-A1-A0SB-11A-00-DX2.svs", "TCGA-B6-A0RE-01Z-00-DX1.svs", "x.svs"]
    slides(tmp_path, *names)
    rows = "".join(f"{name},{'pos' if i % 2 else 'neg'}\n" for i, name in enumerate(names))
    cohort = read_cohort(manifest(tmp_path, "slide,label\n" + rows))
    assert [s.patient for s in cohort] == ["TCGA-A1-A0SB", "TCGA-A1-A0SB", "TCGA-B6-A0RE", "x"]
    assert cohort.grouping == "from TCGA barcodes"
    given = read_cohort(manifest(tmp_path, "slide,label,patient\n" + rows.replace("\n", ",P\n"), "given.csv"))
    assert {s.patient for s in given} == {"P"} and given.grouping == ""     # a patient column is taken as written
