"""Every polygon ``infer`` writes is valid by shapely, on real-looking maps: the bundled IHC sample, a classifier
trained on its tiles by DAB content and a segmentation network trained on its glass/tissue/DAB masks (Otsu), 30
steps each, then both run over the sample as a slide."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mpi4dl_nb.cli.infer_cmd import main as infer_main
from mpi4dl_nb.cli.train_cmd import main as train_main
from mpi4dl_nb.data.sample import dab_density, dab_mask, ihc_image
from tests.support.infer_data import write_slide

STEPS = ["--steps", "30", "--batch-size", "4", "--split-size", "1", "--spatial-size", "0", "--no-progress"]
TILE = 32


def train(*argv: object) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_main([str(a) for a in argv]) == 0


def glass_tissue_dab(rgb: np.ndarray) -> np.ndarray:
    """Labels 0 glass, 1 tissue, 2 DAB: tissue where the saturation passes Otsu's threshold, DAB by Otsu too."""
    from skimage.filters import threshold_otsu

    pixels = rgb.astype(np.float64)
    saturation = (pixels.max(axis=2) - pixels.min(axis=2)) / np.maximum(pixels.max(axis=2), 1.0)
    labels = (saturation > threshold_otsu(saturation)).astype(np.uint8)
    labels[dab_mask(rgb) > 0] = 2
    return labels


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> tuple[Path, Path]:
    """(folder, the IHC sample as a 0.5 µm/px slide): tiles by DAB content, image/mask pairs, the slide."""
    root = tmp_path_factory.mktemp("ihc")
    image = ihc_image()
    tiles = [(r, c) for r in range(0, 512, TILE) for c in range(0, 512, TILE)]
    density = np.array([dab_density(image[r:r + TILE, c:c + TILE]) for r, c in tiles])
    cut = np.median(density)
    for (r, c), value in zip(tiles, density):
        folder = root / "tiles" / ("DAB" if value > cut else "no DAB")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[r:r + TILE, c:c + TILE]).save(folder / f"t_{r}_{c}.png")
    labels = glass_tissue_dab(image)
    (root / "pairs" / "images").mkdir(parents=True)
    (root / "pairs" / "masks").mkdir()
    for r in range(0, 512, 128):
        for c in range(0, 512, 128):
            Image.fromarray(image[r:r + 128, c:c + 128]).save(root / "pairs" / "images" / f"p_{r}_{c}.png")
            Image.fromarray(labels[r:r + 128, c:c + 128]).save(root / "pairs" / "masks" / f"p_{r}_{c}.png")
    return root, write_slide(root / "ihc.tif", image, mpp=0.5)


def assert_every_feature_valid(path: Path) -> int:
    """Every feature's geometry valid by shapely; returns how many there are."""
    import shapely
    from shapely.geometry import shape

    features = json.loads(path.read_text())["features"]
    for feature in features:
        geometry = shape(feature["geometry"])
        assert geometry.is_valid, f"{feature['properties']['classification']['name']}: " \
                                  f"{shapely.is_valid_reason(geometry)}"
    return len(features)


def test_classifier_and_segmentation_polygons_on_the_ihc_sample_are_all_valid(sample):
    root, slide = sample
    train("--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "8",
          "--image-size", TILE, "--datapath", root / "tiles", "--app", "medical", *STEPS,
          "--checkpoint-dir", root / "classifier")
    train("--task", "segmentation", "--model", "unet", "--num-layers", "2", "--num-filters", "4",
          "--image-size", 64, "--datapath", root / "pairs", "--num-classes", "3", *STEPS,
          "--checkpoint-dir", root / "segmenter")
    for name, extra in (("classifier", ["--output-stride", "4"]), ("segmenter", [])):
        out = root / f"{name}.geojson"
        assert infer_main(["--checkpoint", str(root / name), "--slide", str(slide), "--output", str(out),
                           "--no-progress", *extra]) == 0
        assert assert_every_feature_valid(out) > 3
