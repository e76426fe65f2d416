"""``--model``'s argparse type for ``infer``'s own parser (``models/spec.parse_model_name``, refused early with the
forms); goes once ``infer`` generates its flags from its job (train, evaluate, layout: ``run/model_choice.py``)."""
from __future__ import annotations

import argparse

from ..models.spec import parse_model_name


def model_arg(text: str) -> str:
    """``--model``'s type: a family or a named model (``torchvision:resnet50`` ...), refused early with the forms."""
    try:
        return parse_model_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
