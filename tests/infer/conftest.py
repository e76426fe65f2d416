"""One small checkpoint (written by the real ``train`` command) and test slide for every inference test."""

from __future__ import annotations

import pytest

from tests.support.infer_data import make_checkpoint, make_slide, whole_slide_reference


@pytest.fixture(scope="session")
def infer_data(tmp_path_factory):
    """(folder, checkpoint directory, 150 x 330 px slide with bare glass on its right third, its whole-slide
    reference)."""
    root = tmp_path_factory.mktemp("infer")
    checkpoint = make_checkpoint(root / "ck")
    slide = make_slide(root / "slide.tif", 150, 330)
    return root, checkpoint, slide, whole_slide_reference(checkpoint, slide)
