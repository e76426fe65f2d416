"""Layer-list models (ResNet v1/v2, AmoebaNet-D), ``build_model`` and ``ModelSpec`` (which model a run builds)."""
from __future__ import annotations

from .amoebanet import IMAGE_MULTIPLE as AMOEBANET_IMAGE_MULTIPLE
from .amoebanet import amoebanet
from .build import (
    DEFAULT_NUM_FILTERS,
    DEFAULT_NUM_LAYERS,
    MODEL_NAMES,
    RESNET_IMAGE_MULTIPLE,
    build_model,
    image_multiple,
)
from .head import ClassifierHead
from .resnet import resnet, resnet_v1, resnet_v2
from .spec import ModelFamily, ModelSpec

__all__ = ["AMOEBANET_IMAGE_MULTIPLE", "ClassifierHead", "DEFAULT_NUM_FILTERS", "DEFAULT_NUM_LAYERS", "MODEL_NAMES",
           "ModelFamily", "ModelSpec", "RESNET_IMAGE_MULTIPLE", "amoebanet", "build_model", "image_multiple",
           "resnet", "resnet_v1", "resnet_v2"]
