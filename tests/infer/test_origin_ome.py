"""Slides whose data starts away from OpenSlide's origin (``openslide.bounds-*``, as MIRAX reports them): every output
in the coordinates of QuPath's image; the ``.ome.tif`` output read back by independent readers."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from mpi4dl_nb.cli.infer_cmd import main as infer_main
from mpi4dl_nb.data.bounds import SlideBounds, slide_bounds
from tests.support.infer_data import bright_detector, square_slide

SQUARE = (96, 160, 200, 264)      # rows, columns of the bright square in QuPath's image (level 0)
BOUNDS = SlideBounds(x=44, y=20, width=400, height=320)   # QuPath's image inside OpenSlide's 460 x 352 frame
STRIDE = 8                        # level-0 pixels per output cell (4 px at the checkpoint's 1.0 µm/px)


class BoundedSlide:
    """A slide stand-in reporting ``bounds`` as OpenSlide does for MIRAX: the frame's pixels, the bounds' properties."""

    def __init__(self, slide, bounds: SlideBounds) -> None:
        self.inner = slide
        self.properties = {**slide.properties, "openslide.bounds-x": str(bounds.x), "openslide.bounds-y":
                           str(bounds.y), "openslide.bounds-width": str(bounds.width),
                           "openslide.bounds-height": str(bounds.height)}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """The bright detector and a 0.5 µm/px frame whose bounds hold the square at ``SQUARE`` of QuPath's image."""
    root = tmp_path_factory.mktemp("bounded")
    r0, r1, c0, c1 = SQUARE
    frame = (r0 + BOUNDS.y, r1 + BOUNDS.y, c0 + BOUNDS.x, c1 + BOUNDS.x)
    slide = square_slide(root / "s.tif", BOUNDS.y + BOUNDS.height + 12, BOUNDS.x + BOUNDS.width + 16, frame, mpp=0.5)
    return root, bright_detector(root / "ck", mpp=1.0), slide


@pytest.fixture
def reports_bounds(monkeypatch, bounded):
    """OpenSlide opening the test slide reports ``BOUNDS`` (other files open as they are)."""
    import openslide

    opened = openslide.open_slide
    target = str(bounded[2])
    monkeypatch.setattr(openslide, "open_slide",
                        lambda path: BoundedSlide(opened(path), BOUNDS) if str(path) == target else opened(path))


def cli(*argv: object) -> int:
    return infer_main([str(a) for a in argv] + ["--no-progress"])


def test_bounds_are_read_as_qupath_reads_them():
    frame = (900, 700)
    assert slide_bounds({}, frame) == SlideBounds(0, 0, 900, 700, whole=True)
    assert slide_bounds({}, frame).level_size(4.0, (226, 175)) == (226, 175)     # the file's own level size
    properties = {"openslide.bounds-x": "30", "openslide.bounds-y": "12", "openslide.bounds-width": "500",
                  "openslide.bounds-height": "401"}
    bounds = slide_bounds(properties, frame)
    assert bounds == SlideBounds(30, 12, 500, 401) and bounds.offset
    assert bounds.level_size(4.0, (225, 175)) == (125, 101)        # rounded up: the last partial pixel kept
    assert slide_bounds({**properties, "openslide.bounds-x": "n/a"}, frame) == SlideBounds(0, 0, 900, 700, True)


def test_outputs_of_an_offset_slide_land_where_qupath_shows_the_pattern(bounded, reports_bounds):
    import tifffile

    root, checkpoint, slide = bounded
    outputs = [root / n for n in ("m.geojson", "m.csv", "m.ome.tif", "m.tif:labels", "m.png")]
    assert cli("--checkpoint", checkpoint, "--slide", slide, *(a for o in outputs for a in ("--output", o)),
               "--window", 128) == 0
    r0, r1, c0, c1 = SQUARE
    features = json.loads((root / "m.geojson").read_text())["features"]
    found = [f for f in features if f["properties"]["classification"]["name"] == "bright"]
    assert len(found) == 1
    outer = np.array(found[0]["geometry"]["coordinates"][0])
    assert np.abs(outer.min(axis=0) - (c0, r0)).max() <= STRIDE       # QuPath's coordinates, not OpenSlide's
    assert np.abs(outer.max(axis=0) - (c1, r1)).max() <= STRIDE
    with open(root / "m.csv") as handle:
        hot = np.array([(float(r["x"]), float(r["y"])) for r in csv.DictReader(handle) if r["class"] == "bright"])
    assert c0 - STRIDE <= hot[:, 0].min() and hot[:, 0].max() <= c1 + STRIDE
    assert r0 - STRIDE <= hot[:, 1].min() and hot[:, 1].max() <= r1 + STRIDE
    labels = tifffile.imread(root / "m.tif")                        # one map pixel per 8 level-0 px of the bounds
    assert labels.shape == (BOUNDS.height // STRIDE, BOUNDS.width // STRIDE)
    ys, xs = np.nonzero(labels == 1)
    assert abs(ys.min() * STRIDE - r0) <= STRIDE and abs((ys.max() + 1) * STRIDE - r1) <= STRIDE
    assert abs(xs.min() * STRIDE - c0) <= STRIDE and abs((xs.max() + 1) * STRIDE - c1) <= STRIDE
    with tifffile.TiffFile(root / "m.tif") as tif:
        description = json.loads(tif.pages[0].description)
    assert description["bounds"] == {"x": BOUNDS.x, "y": BOUNDS.y, "width": BOUNDS.width, "height": BOUNDS.height}
    probabilities = tifffile.imread(root / "m.ome.tif")               # (classes, rows, columns), same grid
    assert probabilities.shape == (2, *labels.shape)
    assert np.array_equal(np.nan_to_num(probabilities, nan=-1).argmax(axis=0) == 1, labels == 1)


OME = "{http://www.openmicroscopy.org/Schemas/OME/2016-06}"


def test_ome_tiff_carries_physical_sizes_channel_names_and_its_pyramid(bounded, reports_bounds, tmp_path):
    import tifffile

    _, checkpoint, slide = bounded
    out = tmp_path / "m.ome.tif"
    assert cli("--checkpoint", checkpoint, "--slide", slide, "--output", out, "--window", 128) == 0
    with tifffile.TiffFile(out) as tif:
        assert tif.is_ome
        pixels = ET.fromstring(tif.ome_metadata).find(f"{OME}Image/{OME}Pixels")
        series = tif.series[0]
        levels = [level.shape for level in series.levels]
        data = series.asarray()
    assert pixels is not None
    assert float(pixels.get("PhysicalSizeX")) == pytest.approx(4.0)           # 8 level-0 px of 0.5 µm
    assert float(pixels.get("PhysicalSizeY")) == pytest.approx(4.0)
    assert pixels.get("PhysicalSizeXUnit") == "µm" and pixels.get("Type") == "float"
    assert [c.get("Name") for c in pixels.findall(f"{OME}Channel")] == ["dark", "bright"]
    assert levels[0] == (2, BOUNDS.height // STRIDE, BOUNDS.width // STRIDE)
    assert np.isnan(data[:, 0, :]).all()            # the border cells no patch centres on: no data (NaN), not 0
    known = np.isfinite(data).all(axis=0)
    assert np.allclose(data[:, known].sum(axis=0), 1.0, atol=1e-5)
    if shutil.which("vipsheader") is None:
        return                                                                 # libvips not installed here
    fields = subprocess.run(["vipsheader", "-a", str(out)], capture_output=True, text=True, check=True).stdout
    assert f"width: {BOUNDS.width // STRIDE}" in fields and "bands: 1" in fields and "format: float" in fields
    assert "n-pages: 2" in fields                   # one page per class: data, not grey + alpha


def test_training_tiles_and_annotation_masks_use_qupath_coordinates_too(tmp_path):
    """Annotated slides for training: tiles cut from the bounds, QuPath's polygons drawn where the pixels are."""
    from mpi4dl_nb.data.annotated_slides import AnnotatedSlideDataset, annotation_problems
    from mpi4dl_nb.data.pathology import open_slide

    r0, r1, c0, c1 = SQUARE
    path = square_slide(tmp_path / "s.tif", BOUNDS.y + BOUNDS.height + 12, BOUNDS.x + BOUNDS.width + 16,
                        (r0 + BOUNDS.y, r1 + BOUNDS.y, c0 + BOUNDS.x, c1 + BOUNDS.x))
    ring = [[c0, r0], [c1, r0], [c1, r1], [c0, r1], [c0, r0]]              # QuPath's coordinates of the square
    (tmp_path / "s.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [ring]},
         "properties": {"classification": {"name": "bright"}}}]}))

    def opener(slide):
        return BoundedSlide(open_slide(slide), BOUNDS)

    assert annotation_problems(path, ["background", "bright"], opener) is None
    data = AnnotatedSlideDataset([path], 64, ["background", "bright"], min_tissue=0.0, opener=opener)
    assert len(data) == (BOUNDS.height // 64) * (BOUNDS.width // 64)
    drawn = 0
    for index in range(len(data)):
        bright = data.read(index).mean(dim=0) > 0.9
        mask = data.read_mask(index) == 1
        assert bool((mask == bright).all()), index
        drawn += int(mask.sum())
    assert drawn == (r1 - r0) * (c1 - c0)
