"""Pretrained weights: the original model's state dict loaded into its layer list (the classifier replaced when the
classes differ), anything else that does not fit refused with the keys and shapes."""
from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from .named_pool import fresh_keys
from .pieces import engine_keys
from .token_grid import grid_head_keys
from .vit import resampled_positions

WRAPPERS = ("state_dict", "model_state_dict", "model")   # keys training scripts keep a state dict under
SHOWN = 3                      # keys named in a refusal
OPTIONAL = ("num_batches_tracked",)   # older files lack BatchNorm's step counter: the model keeps its own
ESCAPES = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes some of torch's messages carry
SAVE_STATE = "save the model's state dict instead: torch.save(model.state_dict(), path)"
BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")   # a transformer block's keys (timm: blocks.<i>.attn.qkv.weight)


def load_problem(file: Path, err: Exception) -> str:
    """Why torch could not read ``file`` as tensors, in one line naming what to save instead."""
    if isinstance(err, pickle.UnpicklingError):
        return (f"{file} holds pickled Python objects (a whole model or optimizer?), which are not loaded: they "
                f"would run code from the file; {SAVE_STATE}")
    first = ESCAPES.sub("", str(err)).strip().split("\n")[0]
    sentence = first.split(". ")[0].rstrip(".")
    return f"{file} is not a torch state dict ({type(err).__name__}: {sentence}); {SAVE_STATE}"


def read_weights(path: str | Path, flag: str = "--weights") -> dict[str, torch.Tensor]:
    """The state dict in ``path`` (``torch.save(model.state_dict())``, or one under ``state_dict``/``model``;
    a ``module.`` prefix of DataParallel dropped), loaded to the CPU without running code from the file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(flag, f"{str(path)!r}: no such file")
    try:
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:     # a pickle of anything else: torch raises many kinds
        raise ConfigError(flag, load_problem(file, err)) from None
    for key in WRAPPERS:
        if isinstance(data, Mapping) and isinstance(data.get(key), Mapping):
            data = data[key]
    if not isinstance(data, Mapping) or not data or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()):
        raise ConfigError(flag, f"{file} holds no state dict (names -> tensors); save one with "
                                f"torch.save(model.state_dict(), path)")
    if all(k.startswith("module.") for k in data):
        data = {k.removeprefix("module."): v for k, v in data.items()}
    return dict(data)


def classifier_keys(layers: Sequence[nn.Module]) -> list[str]:
    """The original keys of the classifier's tensors: those of the last module holding parameters of its own."""
    keys = engine_keys(layers)
    by_engine = {engine: original for original, engine in keys.items()}
    net = nn.Sequential(*layers)
    last = None
    for name, module in net.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            last = name
    if last is None:
        return []
    return [by_engine[f"{last}.{name}"] for name, _ in net.get_submodule(last).named_parameters(recurse=False)]


def block_count(keys: Sequence[str]) -> int:
    """The transformer blocks ``keys`` hold (``blocks.<i>.``: the highest i + 1; 0: none)."""
    found = [int(m.group(1)) for key in keys if (m := BLOCK.search(key))]
    return max(found) + 1 if found else 0


def depth_hint(weights: Sequence[str], model: Sequence[str]) -> str:
    """``; the file holds 2 transformer blocks, the model 24: add --model-args depth=2`` when the block counts
    differ (a file saved from a shallower or deeper build of the model), else nothing."""
    theirs, ours = block_count(weights), block_count(model)
    if not theirs or not ours or theirs == ours:
        return ""
    return f"; the file holds {theirs} transformer blocks, the model {ours}: add --model-args depth={theirs}"


def shape_text(t: torch.Tensor) -> str:
    return str(list(t.shape))


def listed(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def load_weights(layers: Sequence[nn.Module], weights: Mapping[str, torch.Tensor], *, model: str,
                 source: str = "--weights") -> str | None:
    """Load ``weights`` (keys of the original model ``model`` names) into ``layers``; the note to print when the
    classifier was replaced because its classes differ (None otherwise). ConfigError naming what does not fit:
    the first key of another shape with both shapes, else the first missing and unexpected keys. A ViT's position
    embeddings of another token grid are resampled to the model's (``vit.resampled_positions``; a note says so)."""
    weights, resampled = resampled_positions(layers, weights, source)
    note = replaced_classifier(layers, weights, model=model, source=source)
    return "\n".join(line for line in (resampled, note) if line) or None


def check_weights_fit(build: Callable[[], Sequence[nn.Module]], weights: Mapping[str, torch.Tensor], *, model: str,
                      source: str = "--weights") -> None:
    """``load_weights``'s refusals before anything is built: the layers ``build()`` makes on the meta device (no
    memory, no draw: the random state restored) loaded with the file (copies into meta tensors do nothing). A model
    that cannot be built on the meta device is checked as it loads."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            layers = build()
    except Exception:           # noqa: BLE001 - the real build raises it again, or loads the weights
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)       # torch's "copying ... to a meta parameter is a no-op"
        load_weights(layers, weights, model=model, source=source)


def replaced_classifier(layers: Sequence[nn.Module], weights: Mapping[str, torch.Tensor], *, model: str,
                        source: str) -> str | None:
    """``load_weights`` once the position embeddings fit: the note when the classifier was replaced."""
    net = nn.Sequential(*layers)
    keys = engine_keys(layers)
    own = net.state_dict()
    mine = {original: own[engine] for original, engine in keys.items()}
    grid_head, replaced_keys = grid_head_keys(layers)    # a ViT's token-grid head: new; the file's head not loaded
    fresh = fresh_keys(layers) | grid_head   # a replaced head pool's own tensors (--pool attention): new, kept as drawn
    missing = [k for k in mine if k not in weights and not k.endswith(OPTIONAL) and keys[k] not in fresh]
    unexpected = [k for k in weights if k not in mine and not (replaced_keys and k.startswith(replaced_keys))]
    if len(unexpected) == len(weights):
        raise ConfigError(source, f"none of its {len(weights)} keys is a key of {model} (its first: "
                                  f"{next(iter(weights))}; the model's first: {next(iter(mine), '-')}): a state dict "
                                  f"of another architecture?")
    mismatched = [k for k in mine if k in weights and weights[k].shape != mine[k].shape]
    classifier = classifier_keys(layers)
    if classifier and set(missing) == set(classifier) and not unexpected and not mismatched:
        return headless(net, own, keys, weights, classifier, source)
    replaced = bool(mismatched) and set(mismatched) == set(classifier) and not missing and not unexpected and all(
        weights[k].shape[1:] == mine[k].shape[1:] for k in classifier)
    if mismatched and not replaced:
        first = mismatched[0]
        extra = f"; and {len(missing)} of the model's keys are not in it ({listed(missing)})" if missing else ""
        raise ConfigError(source, f"does not fit {model} (a state dict of another architecture?): {first} has shape "
                                  f"{shape_text(weights[first])} in the file, {shape_text(mine[first])} in the "
                                  f"model{extra}{depth_hint(list(weights), list(mine))}")
    if missing or unexpected:
        parts = [f"missing {listed(missing)}" if missing else "", f"unexpected {listed(unexpected)}"
                 if unexpected else ""]
        raise ConfigError(source, f"does not fit {model}: {'; '.join(p for p in parts if p)}"
                                  f"{depth_hint(list(weights), list(mine))}")
    loaded = {keys[k]: v for k, v in weights.items() if k in mine and not (replaced and k in classifier)}
    net.load_state_dict({**own, **loaded}, strict=True)
    if not replaced:
        return None
    head = classifier[0].rsplit(".", 1)[0]
    before, after = int(weights[classifier[0]].shape[0]), int(mine[classifier[0]].shape[0])
    return (f"{source}: the classifier {head} has {before} outputs in the file and {after} here (--num-classes "
            f"{after}); it is replaced by a new one")


def headless(net: nn.Module, own: Mapping[str, torch.Tensor], keys: Mapping[str, str],
             weights: Mapping[str, torch.Tensor], classifier: Sequence[str], source: str) -> str:
    """Load a trunk saved without its classifier (``num_classes=0``): every key but the classifier's, which keeps
    its fresh draw; the note that says so."""
    loaded = {keys[k]: v for k, v in weights.items()}
    net.load_state_dict({**own, **loaded}, strict=True)
    head = classifier[0].rsplit(".", 1)[0]
    outputs = int(own[keys[classifier[0]]].shape[0])
    return (f"{source}: no classifier in the file (a headless trunk, saved with num_classes=0): a new {head} is drawn "
            f"for --num-classes {outputs}")
