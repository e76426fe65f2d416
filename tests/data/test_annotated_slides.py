"""Slides with QuPath annotations: each box's mask rasterised alone equals the whole level's, at any level;
missing, broken or unusable annotations named before training."""

import json

import numpy as np
import torch

from mpi4dl_nb.data.annotated_slides import AnnotatedSlideDataset, annotation_problems
from mpi4dl_nb.data.rasterize import label_map
from tests.support.pyramid import write_pyramid

CLASSES = ("background", "tumor", "stroma")


def polygon(coordinates, name):
    return {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": coordinates},
            "properties": {"objectType": "annotation", "classification": {"name": name, "color": [255, 0, 0]}}}


def make_slide(folder, features, size=256):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    image = rng.integers(60, 200, (size, size, 3), dtype=np.uint8)
    path = folder / "s1.tif"
    write_pyramid(path, image, levels=2, tile=64)
    (folder / "s1.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    return path


FEATURES = [polygon([[[10, 10], [200, 30], [180, 220], [20, 180], [10, 10]],
                     [[60, 60], [120, 60], [120, 120], [60, 120], [60, 60]]], "tumor"),
            polygon([[[100.5, 100.5], [250, 90], [240, 250], [90, 240], [100.5, 100.5]]], "stroma")]


def test_masks_of_boxes_equal_the_whole_levels_at_every_level(tmp_path):
    slide = make_slide(tmp_path / "slides", FEATURES)
    assert annotation_problems(slide, CLASSES) is None
    for level, downsample in ((0, 1.0), (1, 2.0)):
        data = AnnotatedSlideDataset([slide], 64, CLASSES, level=level, min_tissue=0.0)
        side = 256 // int(downsample)
        drawn = data.annotations[0].by_class(CLASSES)
        whole = torch.from_numpy(label_map(drawn, (0, side, 0, side), downsample))
        assert len(data) == (side // 64) ** 2 and data.num_classes == 3
        for index, tile in enumerate(data.slides.tiles):
            mask = data.read_mask(index)
            assert torch.equal(mask, whole[tile.y:tile.y + 64, tile.x:tile.x + 64])
            assert torch.equal(data.read_mask(index, (7, 40, 0, 33)), mask[7:40, 0:33])
        assert set(torch.unique(whole).tolist()) == {0, 1, 2}
        assert data.read(0, (0, 8, 0, 8)).shape == (3, 8, 8)
        data.close()


def test_annotation_problems_before_training(tmp_path):
    slide = make_slide(tmp_path / "a", FEATURES + [polygon([[[0, 0], [300, 0], [0, 300]]], "tumor")])
    problem = annotation_problems(slide, CLASSES)
    assert "s1.geojson: feature 2: vertex (300, 0) lies outside the slide (0..256 x 0..256" in problem
    assert "class 'stroma' is not among" in annotation_problems(slide, ("background", "tumor"))
    (slide.parent / "s1.geojson").unlink()
    assert "slide s1.tif has no annotations: expected s1.geojson" in annotation_problems(slide, CLASSES)
    (slide.parent / "s1.geojson").write_text("{broken")
    assert "s1.geojson: not valid JSON" in annotation_problems(slide, CLASSES)
