"""A refusal as the command line says it: the Python names of settings (``num_spatial_parts``,
``slice_method='vertical'``) a ConfigError of the library's layers carries turned into their flags
(``--num-spatial-parts``, ``--slice-method vertical``); the Python API keeps its keywords."""
from __future__ import annotations

import functools
import re

from ..schema import Flag, flag_fields

EXTRA = {"max_grad_norm": "--clip-grad-norm"}    # engine keywords a flag of another name sets
# name=value: a quoted value (or several joined by '/'), else a word up to a separator
ASSIGNED = r"(?<![\w.-])({names})=((?:'[^']*'|\"[^\"]*\")(?:/(?:'[^']*'|\"[^\"]*\"))*|[^\s,;)]+)"


@functools.cache
def flags_of_names() -> dict[str, Flag]:
    """Each Python name of a train, evaluate or infer setting (its field's and its keyword's) with its flag."""
    from ..infer.job import InferJob
    from ..run.evaluate_job import EvaluateJob
    from ..run.job import TrainJob

    found: dict[str, Flag] = {}
    for job in (TrainJob, EvaluateJob, InferJob):
        for item in flag_fields(job):
            for name in (item.path[-1], item.flag.dest):
                found.setdefault(name, item.flag)
    return found


def option_of(name: str) -> str | None:
    """The flag of the Python name ``name`` (None: none)."""
    flag = flags_of_names().get(name)
    return flag.option if flag is not None else EXTRA.get(name)


def assigned(match: re.Match[str]) -> str:
    """``name=value`` as its flag takes it: ``--flag value`` (quotes dropped); a switch given or left out."""
    name, value = match[1], match[2].replace("'", "").replace('"', "")
    flag = flags_of_names().get(name)
    option = option_of(name)
    if flag is not None and flag.switch and value in ("True", "False"):
        given = (value == "True") != flag.option.startswith("--no-")
        return option if given else f"without {option}"
    return f"{option} {value}"


def as_flags(message: str) -> str:
    """``message`` (``knob: detail``) with its Python names as flags when its knob is a Python name with a flag;
    unchanged otherwise (a message naming flags already, or its knob no setting's)."""
    knob, sep, detail = message.partition(": ")
    option = option_of(knob)
    return f"{option}: {names_as_flags(detail)}" if sep and option is not None else message


def names_as_flags(text: str) -> str:
    """``text`` with the settings' Python names as their flags: ``name=value`` as ``--flag value``, a name with an
    underscore anywhere, a one-word name (``parts``) before a value."""
    names = sorted({*flags_of_names(), *EXTRA}, key=len, reverse=True)
    text = re.sub(ASSIGNED.format(names="|".join(map(re.escape, names))), assigned, text)
    bare = [name for name in names if "_" in name]
    text = re.sub(rf"(?<![\w.-])({'|'.join(map(re.escape, bare))})(?![\w=])", lambda m: option_of(m[1]) or m[1],
                  text)
    words = [name for name in names if "_" not in name]       # "parts" is a word too: a flag before a value only
    return re.sub(rf"(?<![\w.-])({'|'.join(map(re.escape, words))})(?= (?:\d|in \[|[<>]=? ))",
                  lambda m: option_of(m[1]) or m[1], text)
