"""A refusal as the command line says it: the Python names of settings a ConfigError of the library's layers carries
(``num_spatial_parts``, ``slice_method='vertical'``) as their flags (``--num-spatial-parts``, ``--slice-method
vertical``); the Python API keeps its keywords."""
from __future__ import annotations

import functools
import re

from ..schema import Flag, flag_fields

EXTRA = {"max_grad_norm": "--clip-grad-norm"}    # engine keywords a flag of another name sets
QUOTED = r"(?:'[^']*'|\"[^\"]*\")"
VALUE = re.compile(r" (?:\d|in \[|[<>]=? )")      # what follows a one-word name ("parts") that is its value


@functools.cache
def flags_of_names() -> dict[str, Flag]:
    """Each Python name of a train, evaluate or infer setting (its field's and its keyword's) with its flag."""
    from ..infer.job import InferJob
    from ..run.evaluate_job import EvaluateJob
    from ..run.job import TrainJob

    return {name: item.flag for job in (InferJob, EvaluateJob, TrainJob) for item in flag_fields(job)
            for name in (item.path[-1], item.flag.dest)}


def option_of(name: str) -> str | None:
    flag = flags_of_names().get(name)
    return flag.option if flag is not None else EXTRA.get(name)


def assigned(match: re.Match[str]) -> str:
    """``name=value`` as its flag takes it: ``--flag value`` (quotes dropped); a switch given or left out."""
    name, value = match[1], re.sub("['\"]", "", match[2])
    flag, option = flags_of_names().get(name), option_of(name) or name
    if flag is not None and flag.switch and value in ("True", "False"):
        return option if (value == "True") != flag.option.startswith("--no-") else f"without {option}"
    return f"{option} {value}"


def as_flags(message: str) -> str:
    """``message`` (``knob: detail``) with its Python names as flags when its knob is a Python name with a flag;
    unchanged otherwise (a message naming flags already, or its knob no setting's)."""
    knob, sep, detail = message.partition(": ")
    option = option_of(knob)
    return f"{option}: {names_as_flags(detail)}" if sep and option is not None else message


def names_as_flags(text: str) -> str:
    """``text`` with the settings' Python names as flags: ``name=value`` as ``--flag value``, a name with an
    underscore anywhere, a one-word name (``parts``) before a value only."""
    names = sorted({*flags_of_names(), *EXTRA}, key=len, reverse=True)
    listed = "|".join(map(re.escape, names))
    text = re.sub(rf"(?<![\w.-])({listed})=({QUOTED}(?:/{QUOTED})*|[^\s,;)]+)", assigned, text)
    return re.sub(rf"(?<![\w.-])({listed})(?![\w=])", lambda m: option_of(m[1]) or m[1] if "_" in m[1] or VALUE.match(
        m.string, m.end()) else m[1], text)
