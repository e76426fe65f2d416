"""The model options several commands take (train, evaluate, infer, layout, tune), each declared once: a job's field is
``OPTION.field(default)``."""
from __future__ import annotations

from ..schema import Bounds, option, whole_number
from .model_args import parse_model_args
from .presets import PRESETS
from .spec import parse_model_name

MODEL_HELP = ("network: resnet (MPI4DL's CIFAR-style ResNet: 3 stages, stride 4, for small images; for an "
              "ImageNet-style ResNet use torchvision:resnet50), amoebanet (AmoebaNet-D), unet, unet3d (volumes: "
              "--image-size D,H,W), swinunetr3d (volumes: a 3-D Swin encoder with a convolutional decoder), "
              "torchvision:NAME, "
              "timm:NAME (pip install 'mpi4dl-nb[models]'), a pathology foundation model's architecture by name (" +
              ", ".join(PRESETS) + "; docs/your-own-model.md), or package.module:callable (called with "
              "num_classes, returns an nn.Module or a layer list)")
AT_LEAST_ONE = Bounds(1)

MODEL = option("--model", MODEL_HELP + "; evaluate, infer: refuse a checkpoint of another network (the checkpoint "
                                       "names the network it holds); layout: print the stage cut of its layer list "
                                       "for the configuration", parse=parse_model_name, metavar="MODEL")
NUM_CLASSES = option("--num-classes", "number of classes (train: refused when it disagrees with the data; evaluate: "
                                      "refuse a checkpoint whose model has another count)", parse=whole_number,
                     bounds=AT_LEAST_ONE)
NUM_LAYERS = option("--num-layers", "AmoebaNet: number of normal/reduction cells (default 18); ResNet: depth (default "
                                    "110; v1 6n+2, v2 9n+2); swinunetr3d: Swin stages (default 2)",
                    parse=whole_number, bounds=AT_LEAST_ONE)
NUM_FILTERS = option("--num-filters", "AmoebaNet: filters (default 416); ResNet: base width (default 16); "
                                      "swinunetr3d: feature size (default 12, a multiple of 3)", parse=whole_number,
                     bounds=AT_LEAST_ONE)
MODEL_ARGS = option("--model-args", "keyword arguments of a named model's constructor, k=v,... (numbers, true/false, "
                                    "none, tuples as (a,b), names; timm layers by name: mlp_layer=swiglu_packed, "
                                    "act_layer=silu, norm_layer=layernorm), e.g. depth=2 for a short trial; recorded "
                                    "in the checkpoint (evaluate, infer and export rebuild the same network)",
                    parse=parse_model_args, metavar="K=V,...")
