"""``--model-args k=v,...``: keyword arguments of a named model's constructor, typed, recorded and resolved.

Values are numbers, booleans (``true``/``false``), ``none``, tuples in parentheses (``img_size=(224,224)``) or
names; a timm layer named by its name (``mlp_layer=swiglu_packed``, ``act_layer=silu``, ``norm_layer=layernorm``)
becomes timm's class as the model is built. The record keeps the plain values, so a checkpoint rebuilds the same
network in ``evaluate``, ``infer`` and ``export``.
"""
from __future__ import annotations

import difflib
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType

from ..errors import ConfigError

Scalar = int | float | bool | str | None
Value = Scalar | tuple[Scalar, ...]
FLAG = "--model-args"
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
# timm's MLP classes by the names a model card's code uses for them (timm.layers.<class>)
MLP_LAYERS = {"mlp": "Mlp", "swiglu": "SwiGLU", "swiglu_packed": "SwiGLUPacked", "glu": "GluMlp",
              "gated": "GatedMlp"}
RESERVED = ("num_classes", "pretrained", "in_chans", "img_size")   # set by other flags (--num-classes, --image-size)
UNEXPECTED = re.compile(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'")   # a key not taken


@dataclass(frozen=True)
class ModelArgs:
    """Constructor keyword arguments in the order given (later keys override earlier ones when merged)."""

    items: tuple[tuple[str, Value], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.items)

    def __str__(self) -> str:
        return self.text()

    def __iter__(self) -> Iterator[tuple[str, Value]]:
        return iter(self.items)

    def merged(self, over: ModelArgs) -> ModelArgs:
        """These arguments with ``over``'s replacing those of the same key (a preset under the user's)."""
        given = dict(over.items)
        return ModelArgs(tuple((k, v) for k, v in self.items if k not in given) + over.items)

    def to_dict(self) -> dict[str, object]:
        """Plain values for a checkpoint or JSON (tuples as lists)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in self.items}

    @classmethod
    def from_dict(cls, data: Mapping[str, object] | None) -> ModelArgs:
        """The arguments ``to_dict`` wrote (none when missing); ValueError for a value of another kind."""
        if not data:
            return cls()
        return cls(tuple((str(key), plain_value(str(key), value)) for key, value in data.items()))

    def text(self) -> str:
        """``k=v,...`` as the flag takes it."""
        return ",".join(f"{key}={arg_text(value)}" for key, value in self.items)

    def keywords(self, resolve: Callable[[str, Value], object] | None = None) -> dict[str, object]:
        """The constructor's keywords, each value through ``resolve`` (a library's layer names to classes)."""
        return {key: value if resolve is None else resolve(key, value) for key, value in self.items}


NO_ARGS = ModelArgs()


def plain_value(key: str, value: object) -> Value:
    """A recorded value back as a ``Value``; ValueError naming ``key`` for anything else."""
    if isinstance(value, list | tuple):
        if not all(v is None or isinstance(v, int | float | bool | str) for v in value):
            raise ValueError(f"model argument {key!r}: a tuple of numbers, booleans or names, not {value!r}")
        return tuple(value)
    if value is None or isinstance(value, int | float | bool | str):
        return value
    raise ValueError(f"model argument {key!r}: {value!r} is not a number, boolean, name or tuple")


def arg_text(value: Value) -> str:
    """A value as ``parse_model_args`` reads it back."""
    if isinstance(value, tuple):
        return "(" + ",".join(arg_text(v) for v in value) + ")"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "none" if value is None else str(value)


def parse_scalar(text: str) -> Scalar:
    """``"5.3375"`` -> 5.3375, ``"4"`` -> 4, ``"true"`` -> True, ``"none"`` -> None, else the text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def split_top(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses; ValueError for unbalanced parentheses."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            raise ValueError(f"{text!r}: a ')' without its '('")
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"{text!r}: a '(' without its ')'")
    return [*parts, text[start:]]


def parse_value(text: str) -> Value:
    """One value: a scalar or a parenthesised tuple of scalars."""
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        inner = text[1:-1].strip()
        return tuple(parse_scalar(part.strip()) for part in split_top(inner) if part.strip()) if inner else ()
    return parse_scalar(text)


def parse_model_args(text: str) -> ModelArgs:
    """``"mlp_layer=swiglu_packed,depth=2,img_size=(224,224)"`` -> ModelArgs; ValueError naming the bad pair."""
    items: dict[str, Value] = {}
    for pair in split_top(text.strip()) if text.strip() else []:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not KEY.match(key) or not value.strip():
            raise ValueError(f"{pair.strip()!r}: give key=value pairs separated by commas "
                             f"(e.g. mlp_layer=swiglu_packed,act_layer=silu,depth=2)")
        if key in RESERVED:
            raise ValueError(f"{key}: set by its own flag (--num-classes, --image-size, the data's channels); "
                             f"drop it from {FLAG}")
        items[key] = parse_value(value)
    return ModelArgs(tuple(items.items()))


def timm_resolver(timm: ModuleType) -> Callable[[str, Value], object]:
    """Resolve a ``*_layer`` argument named by a string to timm's class: an MLP (``mlp_layer``: mlp, swiglu,
    swiglu_packed, glu, gated), an activation (``act_layer``) or a norm (``norm_layer``)."""
    layers = timm.layers

    def resolve(key: str, value: Value) -> object:
        if not key.endswith("_layer") or not isinstance(value, str):
            return value
        if key.startswith("mlp"):
            name = MLP_LAYERS.get(value.lower())
            if name is None:
                raise ConfigError(FLAG, f"{key}={value}: not an MLP timm knows by name; use one of "
                                        f"{', '.join(MLP_LAYERS)}")
            return getattr(layers, name)
        lookup = layers.get_act_layer if "act" in key else layers.get_norm_layer if "norm" in key else None
        if lookup is None:
            raise ConfigError(FLAG, f"{key}={value}: only mlp_layer, act_layer and norm_layer are resolved by name")
        try:
            found = lookup(value)
        except Exception as err:     # timm raises its own kinds for an unknown name
            raise ConfigError(FLAG, f"{key}={value}: timm does not know it ({err})") from None
        if found is None:
            raise ConfigError(FLAG, f"{key}={value}: timm does not know it")
        return found

    return resolve


def refused_args(args: ModelArgs, label: str, err: Exception) -> ConfigError:
    """The one line for ``args`` that ``label``'s constructor refused with ``err``: a key it does not take (with the
    keys of its constructor closest to it), or a name given where it computes with a number (the value named), else
    every argument with the constructor's reason."""
    text = str(err)
    given = dict(args.items)
    unknown = UNEXPECTED.search(text)
    if unknown is not None and unknown.group(2) in given:
        key = unknown.group(2)
        near = difflib.get_close_matches(key, constructor_keys(label, unknown.group(1)), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        return ConfigError(FLAG, f"{key}={arg_text(given[key])}: {label} does not take {key}{hint}")
    names = [(key, value) for key, value in args.items if isinstance(value, str) and not key.endswith("_layer")]
    if isinstance(err, TypeError) and names:
        shown = ", ".join(f"{key}={value}" for key, value in names)
        values = " or ".join(f"{key}'s value {value!r}" for key, value in names)
        return ConfigError(FLAG, f"{shown}: {label} wants a number, not the name in {values} ({text}); give "
                                 f"{' and '.join(key for key, _ in names)} a number")
    return ConfigError(FLAG, f"{args.text()}: {label} does not take them ({text})")


def constructor_keys(label: str, class_name: str) -> tuple[str, ...]:
    """The keyword arguments of the class ``class_name`` of ``label``'s library (timm, torchvision, or a callable's
    package) as loaded; none when it is not found."""
    root = label.split(":", 1)[0] if label.startswith(("timm:", "torchvision:")) else label.split(".", 1)[0]
    for name, module in list(sys.modules.items()):
        found = getattr(module, class_name, None) if name.split(".", 1)[0] == root else None
        if inspect.isclass(found):
            try:
                return tuple(inspect.signature(found.__init__).parameters)[1:]
            except (TypeError, ValueError):
                return ()
    return ()
