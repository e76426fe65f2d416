"""Layer-list models (ResNet v1/v2, AmoebaNet-D), ``build_model``, ``ModelSpec`` (which model a run builds) and your
own models: ``layer_list`` (cut a torchvision/timm/any chain CNN), pretrained weights, input normalisation."""
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
from .cut import layer_list
from .head import ClassifierHead
from .normalize import IMAGENET, Normalization, normalized
from .pieces import engine_state_dict, original_state_dict
from .resnet import resnet, resnet_v1, resnet_v2
from .spec import ModelFamily, ModelSpec
from .weights import load_weights, read_weights

__all__ = ["AMOEBANET_IMAGE_MULTIPLE", "ClassifierHead", "DEFAULT_NUM_FILTERS", "DEFAULT_NUM_LAYERS", "IMAGENET",
           "MODEL_NAMES", "ModelFamily", "ModelSpec", "Normalization", "RESNET_IMAGE_MULTIPLE", "amoebanet",
           "build_model", "engine_state_dict", "image_multiple", "layer_list", "load_weights", "normalized",
           "original_state_dict", "read_weights", "resnet", "resnet_v1", "resnet_v2"]
