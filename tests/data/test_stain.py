"""Stain normalisation: Macenko finds known stain vectors and brings an image to the reference's stain, Reinhard
matches lαβ statistics, any box of an image reads as the same box of the whole normalised image, the normaliser
round-trips through a checkpoint record, and the flags are refused with the fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mpi4dl_nb.checkpoint.record import DataRecord, RunRecord
from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.data import IHCSampleDataset, SlideDataset, SyntheticDataset, TileFolderDataset, ihc_image
from mpi4dl_nb.data.apps import AppKind
from mpi4dl_nb.data.stain import (
    MIN_OD,
    StainMethod,
    StainNormalizer,
    fit_reference,
    from_density,
    macenko_fit,
    optical_density,
    reinhard_fit,
    to_lab,
)
from mpi4dl_nb.data.stain_reads import with_stain
from mpi4dl_nb.models.spec import ModelFamily, ModelSpec

HAEMATOXYLIN = np.array([0.65, 0.70, 0.29])
EOSIN = np.array([0.07, 0.99, 0.11])
OTHER_H = np.array([0.55, 0.75, 0.37])      # another lab's haematoxylin and eosin
OTHER_E = np.array([0.15, 0.95, 0.27])
BOXES = [(0, 13, 0, 29), (0, 13, 29, 48), (13, 48, 0, 29), (13, 48, 29, 48)]


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def stained_image(h: np.ndarray, e: np.ndarray, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """A 64x64 image of two stains ``h``, ``e`` in random amounts (some pixels one stain only), values 0..255."""
    rng = np.random.default_rng(seed)
    amounts = rng.uniform(0.05, 1.0, size=(64 * 64, 2)) * scale
    amounts[:400, 1] = 0.0           # haematoxylin only
    amounts[400:800, 0] = 0.0        # eosin only
    od = amounts @ np.stack([unit(h), unit(e)])
    return from_density(od).reshape(64, 64, 3)


def save(path, rgb: np.ndarray):
    Image.fromarray(np.round(rgb).astype(np.uint8)).save(path)
    return path


def cosines(found: np.ndarray, h: np.ndarray, e: np.ndarray) -> tuple[float, float]:
    return float(found[:, 0] @ unit(h)), float(found[:, 1] @ unit(e))


def test_macenko_finds_the_stain_vectors_haematoxylin_first():
    vectors, maxima = macenko_fit(stained_image(HAEMATOXYLIN, EOSIN))
    assert min(cosines(vectors, HAEMATOXYLIN, EOSIN)) > 0.99       # pale pure-eosin pixels count as background
    assert np.all(maxima > 0.5)


def test_macenko_brings_an_image_to_the_reference_stain(tmp_path):
    reference = fit_reference("macenko", save(tmp_path / "ref.png", stained_image(HAEMATOXYLIN, EOSIN)))
    source = stained_image(OTHER_H, OTHER_E, scale=0.6, seed=1)
    before, _ = macenko_fit(source)
    assert min(cosines(before, HAEMATOXYLIN, EOSIN)) < 0.99           # another stain to begin with
    vectors, maxima = macenko_fit(reference.map_for(source)(source))
    target = np.array(reference.first).reshape(2, 3).T
    assert min(cosines(vectors, target[:, 0], target[:, 1])) > 0.999
    np.testing.assert_allclose(maxima, reference.second, rtol=0.05)


def test_reinhard_matches_the_reference_statistics_and_leaves_the_reference_alone(tmp_path):
    rgb = ihc_image().astype(np.float64)
    reference = fit_reference("reinhard", save(tmp_path / "ref.png", rgb[256:, 256:]))
    ref = rgb[256:, 256:]
    assert np.abs(reference.map_for(ref)(ref) - ref).max() < 1e-9
    source = np.clip(rgb[:256, :256] * np.array([0.8, 0.9, 1.1]), 0, 255)
    chosen = (optical_density(source) >= MIN_OD).all(axis=-1)      # the pixels the source's statistics are of
    lab = to_lab(reference.map_for(source)(source)[chosen])
    assert abs(reinhard_fit(source)[0][0] - reference.first[0]) > 0.3          # much darker to begin with
    np.testing.assert_allclose(lab.mean(axis=0), reference.first, atol=0.005)  # off only where pixels clip at 255
    np.testing.assert_allclose(lab.std(axis=0), reference.second, rtol=0.05)


def test_blank_image_is_left_as_it_is_and_a_blank_reference_refused(tmp_path):
    white = np.full((32, 32, 3), 250.0)
    normalizer = fit_reference("macenko", save(tmp_path / "ref.png", stained_image(HAEMATOXYLIN, EOSIN)))
    assert np.array_equal(normalizer.map_for(white)(white), white)
    with pytest.raises(ConfigError, match="--stain-reference: .*fewer than 64 stained pixels"):
        fit_reference("reinhard", save(tmp_path / "white.png", white))


def stitched(dataset, index: int) -> torch.Tensor:
    """Image ``index`` read box by box (four rank-like boxes) and put together."""
    out = torch.zeros(3, 48, 48)
    for r0, r1, c0, c1 in BOXES:
        out[:, r0:r1, c0:c1] = dataset.read(index, (r0, r1, c0, c1))
    return out


@pytest.fixture(scope="module")
def normalizers(tmp_path_factory):
    path = save(tmp_path_factory.mktemp("stain") / "ref.png", stained_image(HAEMATOXYLIN, EOSIN))
    return {m: fit_reference(m, path) for m in StainMethod}


@pytest.mark.parametrize("method", list(StainMethod))
def test_any_box_reads_as_that_box_of_the_whole_normalised_image(tmp_path, normalizers, method):
    folder = tmp_path / "tiles"
    folder.mkdir()
    for k in range(2):
        save(folder / f"t{k}.png", stained_image(OTHER_H, OTHER_E, scale=0.5 + 0.3 * k, seed=k)[:48, :48])
    for dataset in (TileFolderDataset(folder, 48), IHCSampleDataset(48, num_classes=2)):
        stored = dataset.read(1)
        with_stain(dataset, normalizers[method])
        whole = dataset.read(1)
        assert not torch.allclose(whole, stored, atol=1e-3), "the normaliser changed nothing"
        assert torch.equal(stitched(dataset, 1), whole)


@pytest.mark.parametrize("method", list(StainMethod))
def test_an_image_is_normalised_by_its_whole_stain(normalizers, method):
    from mpi4dl_nb.data.stain_reads import as_values, stain_normalized

    dataset = with_stain(IHCSampleDataset(48, num_classes=2), normalizers[method])
    stored = dataset.read_pixels(3)
    expected = stain_normalized(stored, normalizers[method].map_for(as_values(stored)))
    assert torch.equal(dataset.read(3), expected)


def test_a_slides_tiles_share_the_stain_of_its_overview(tmp_path, normalizers):
    from mpi4dl_nb.data.pathology import slide_overview
    from mpi4dl_nb.data.stain_reads import stain_normalized
    from tests.support.pyramid import write_pyramid

    image = np.full((256, 256, 3), 245, np.uint8)
    image[:, :192] = ihc_image()[:256, :192]
    write_pyramid(tmp_path / "slide.tif", image)
    dataset = with_stain(SlideDataset([tmp_path / "slide.tif"], 64, min_tissue=0.5), normalizers[StainMethod.MACENKO])
    assert len(dataset) >= 2
    pixel_map = normalizers[StainMethod.MACENKO].map_for(slide_overview(dataset.slide(0)))
    for index in (0, len(dataset) - 1):
        assert torch.equal(dataset.read(index), stain_normalized(dataset.read_pixels(index), pixel_map))
        assert torch.equal(stitched_slide(dataset, index), dataset.read(index))
    assert list(dataset.stain_maps) == [("slide", 0)]


def test_a_whole_slide_canvas_is_normalised_by_its_slides_overview(tmp_path, normalizers):
    from mpi4dl_nb.data.canvas import SlideCanvases
    from mpi4dl_nb.data.pathology import slide_overview
    from mpi4dl_nb.data.stain_reads import stain_normalized
    from tests.support.pyramid import write_pyramid

    image = np.full((256, 256, 3), 245, np.uint8)
    image[32:200, 40:220] = ihc_image()[:168, :180]
    write_pyramid(tmp_path / "slide.tif", image)
    canvases = with_stain(SlideCanvases([tmp_path / "slide.tif"], [0], ["a"], 64), normalizers[StainMethod.REINHARD])
    pixel_map = normalizers[StainMethod.REINHARD].map_for(slide_overview(canvases.slide(0)))
    whole = canvases.read(0)
    assert torch.equal(whole, stain_normalized(canvases.read_pixels(0), pixel_map))
    assert torch.equal(stitched_slide(canvases, 0), whole)


def stitched_slide(dataset, index: int) -> torch.Tensor:
    out = torch.zeros(3, 64, 64)
    for r0, r1, c0, c1 in [(0, 21, 0, 40), (0, 21, 40, 64), (21, 64, 0, 40), (21, 64, 40, 64)]:
        out[:, r0:r1, c0:c1] = dataset.read(index, (r0, r1, c0, c1))
    return out


def test_generated_images_are_refused():
    normalizer = StainNormalizer(StainMethod.REINHARD, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    with pytest.raises(ConfigError, match="--stain-normalize: reinhard normalises .*SyntheticDataset has none"):
        with_stain(SyntheticDataset(16, 2, 4), normalizer)


def test_a_python_run_records_the_normaliser_its_data_reads_through(normalizers):
    from mpi4dl_nb.data.sample import IHCMaskDataset
    from mpi4dl_nb.evaluation.split import Subset
    from mpi4dl_nb.run.python_run import record_for

    spec = ModelSpec(ModelFamily.RESNET, 8, 4, 2, 1)
    for dataset in (IHCSampleDataset(48, num_classes=2), IHCMaskDataset(48)):
        assert record_for(spec, dataset, 2).stain is None
        normalised = with_stain(dataset, normalizers[StainMethod.MACENKO])
        assert record_for(spec, Subset(normalised, [0, 1]), 2).stain == normalizers[StainMethod.MACENKO]


def test_the_checkpoint_record_keeps_the_normaliser(normalizers):
    for normalizer in normalizers.values():
        record = RunRecord(ModelSpec(ModelFamily.RESNET, 8, 4, 2, 1), DataRecord(AppKind.MEDICAL, 48, 2, "float64"),
                           stain=normalizer).at(3, "abc")
        back = RunRecord.from_payload(record.to_payload(), "ck.pt")
        assert back.stain == normalizer and back.stain.reference == "ref.png" and len(back.stain.fingerprint) == 16
    with pytest.raises(ValueError, match="field 'method'"):
        StainNormalizer.from_dict({"method": "vahadane", "first": [], "second": []})
    with pytest.raises(ValueError, match="macenko keeps 6 and 2 numbers"):
        StainNormalizer.from_dict({"method": "macenko", "first": [1.0, 2.0], "second": [1.0, 2.0]})


def flags(**given: object) -> dict[str, object]:
    """``train``'s stain flags as ``dl.train`` keywords (``--app medical`` unless given)."""
    return {"app": "medical", **given}


@pytest.mark.parametrize("given, message", [
    ({"stain_normalize": "macenko"}, "--stain-normalize: needs --stain-reference IMAGE"),
    ({"stain_reference": "x.png"}, "--stain-reference: needs --stain-normalize macenko|reinhard"),
    ({"stain_normalize": "reinhard", "stain_reference": "x.png", "app": "synthetic"}, "--app synthetic has none"),
    ({"stain_normalize": "reinhard", "stain_reference": "nowhere.png"}, "--stain-reference: 'nowhere.png' is not "
                                                                        "a file"),
])
def test_flags_are_refused_with_the_fix(tmp_path, monkeypatch, given, message):
    from mpi4dl_nb.run.job import TrainJob

    monkeypatch.chdir(tmp_path)
    save(tmp_path / "x.png", stained_image(HAEMATOXYLIN, EOSIN))
    with pytest.raises(ConfigError) as err:
        TrainJob.of(**flags(**given)).check()
    assert message in str(err.value)


def test_flags_give_the_request(tmp_path):
    from mpi4dl_nb.run.job import TrainJob

    path = save(tmp_path / "x.png", stained_image(HAEMATOXYLIN, EOSIN))
    request = TrainJob.of(**flags(stain_normalize="macenko", stain_reference=str(path))).check().data.stain_request
    assert request is not None and request.method is StainMethod.MACENKO and request.reference == str(path)
    assert TrainJob.of().check().data.stain_request is None


def test_a_large_image_is_estimated_from_a_fixed_overview(normalizers):
    from mpi4dl_nb.data.stain_reads import as_values, stain_normalized

    dataset = with_stain(IHCSampleDataset(1100, num_classes=1), normalizers[StainMethod.REINHARD])
    stored = dataset.read_pixels(0)
    overview = dataset.stain_pixels(0)
    assert overview.shape == (550, 550, 3) and np.array_equal(overview, as_values(stored)[::2, ::2])
    whole = dataset.read(0)
    assert torch.equal(whole, stain_normalized(stored, normalizers[StainMethod.REINHARD].map_for(overview)))
    assert torch.equal(dataset.read(0, (300, 1100, 0, 700)), whole[:, 300:, :700])
