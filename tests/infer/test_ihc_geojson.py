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


@pytest.fixture(scope="module")
def classifier(sample) -> Path:
    """A ResNet-8 trained 30 steps on the sample's 32 px tiles by DAB content (classes 'DAB', 'no DAB')."""
    root, _ = sample
    train("--model", "resnet", "--resnet-version", "1", "--num-layers", "8", "--num-filters", "8",
          "--image-size", TILE, "--datapath", root / "tiles", "--app", "medical", *STEPS,
          "--checkpoint-dir", root / "classifier")
    return root / "classifier"


def test_classifier_and_segmentation_polygons_on_the_ihc_sample_are_all_valid(sample, classifier):
    root, slide = sample
    train("--task", "segmentation", "--model", "unet", "--num-layers", "2", "--num-filters", "4",
          "--image-size", 64, "--datapath", root / "pairs", "--num-classes", "3", *STEPS,
          "--checkpoint-dir", root / "segmenter")
    for name, extra in (("classifier", ["--output-stride", "4"]), ("segmenter", [])):
        out = root / f"{name}.geojson"
        assert infer_main(["--checkpoint", str(root / name), "--slide", str(slide), "--output", str(out),
                           "--no-progress", *extra]) == 0
        assert assert_every_feature_valid(out) > 3


def test_tile_mode_cells_are_the_classifier_on_their_tiles_and_peak_on_the_pattern(sample, classifier, tmp_path):
    """--map-mode tiles: each cell equals the trained classifier on its lone tile (read as the cell names it), the
    cells whose tile leaves the slide are NaN, and the trained detector's peak lands within a quarter tile of a
    DAB-rich tile pasted on DAB-poor tissue."""
    import torch

    from mpi4dl_nb.infer.reader import SlideReader
    from mpi4dl_nb.infer.trained import load_network

    image = ihc_image()
    tiles = [(r, c) for r in range(0, 512, TILE) for c in range(0, 512, TILE)]
    density = [dab_density(image[r:r + TILE, c:c + TILE]) for r, c in tiles]
    poor = [tiles[i] for i in np.argsort(density)[:16]]
    rich = tiles[int(np.argmax(density))]
    canvas = np.concatenate([np.concatenate([image[r:r + TILE, c:c + TILE] for r, c in poor[k:k + 4]], axis=1)
                             for k in range(0, 16, 4)], axis=0)                         # 128 x 128 of poor tiles
    top, left = 44, 60                                                                 # off the tile grid
    canvas[top:top + TILE, left:left + TILE] = image[rich[0]:rich[0] + TILE, rich[1]:rich[1] + TILE]
    slide = write_slide(tmp_path / "pattern.tif", canvas, mpp=None)
    out = tmp_path / "tiles.npy"
    assert infer_main(["--checkpoint", str(classifier), "--slide", str(slide), "--output", str(out),
                       "--map-mode", "tiles", "--output-stride", "4", "--dtype", "float64", "--no-progress"]) == 0
    probabilities = np.load(out)
    trained = load_network(str(classifier), dtype=torch.float64)
    dab = trained.classes.index("DAB")
    stride = 4
    fits = (canvas.shape[0] - TILE) // stride + 1
    assert np.isnan(probabilities[:, fits:, :]).all() and np.isnan(probabilities[:, :, fits:]).all()
    known = probabilities[:, :fits, :fits]
    assert np.isfinite(known).all()
    reader = SlideReader(slide)
    net = torch.nn.Sequential(*trained.layers).eval()
    for row, col in ((0, 0), (11, 15), (fits - 1, fits - 2)):
        pixels = reader.read((row * stride, row * stride + TILE, col * stride, col * stride + TILE))
        with torch.no_grad():
            alone = torch.softmax(net(torch.from_numpy(pixels).permute(2, 0, 1)[None].double() / 255.0), dim=1)
        assert np.allclose(known[:, row, col], alone[0].numpy(), rtol=0, atol=1e-12)
    row, col = np.unravel_index(np.argmax(known[dab]), known[dab].shape)
    assert abs(row * stride - top) <= TILE / 4 and abs(col * stride - left) <= TILE / 4, (row, col)
