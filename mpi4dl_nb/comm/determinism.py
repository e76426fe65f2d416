"""Exactness runs on CUDA: torch's deterministic algorithms (cuDNN's, cuBLAS's) during a run, an op without one
refused by name."""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

import torch

from ..errors import ConfigError
from ..schema import option

REFUSED_OP = re.compile(r"(\S+) does not have a deterministic implementation")


class Determinism(str, Enum):
    """Whether a run uses torch's deterministic algorithms: auto (float64 runs, or on already), always, never."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    def wanted(self, dtype: torch.dtype) -> bool:
        return self is Determinism.ON or (self is Determinism.AUTO and (
            dtype == torch.float64 or torch.are_deterministic_algorithms_enabled()))


DETERMINISTIC = option("--deterministic", "torch's deterministic algorithms, cuDNN's and cuBLAS's (CUDA reruns bit "
                                          "for bit; an op with none is refused by name): auto: with --dtype float64",
                       parse=Determinism, choices=tuple(d.value for d in Determinism))


@contextmanager
def deterministic_run(choice: Determinism, dtype: torch.dtype) -> Iterator[bool]:
    """The body with torch's and cuDNN's deterministic algorithms as ``choice`` says for ``dtype`` (yields whether on;
    ``CUBLAS_WORKSPACE_CONFIG`` set when unset), the process's setting back after; torch's refusal of an op with no
    deterministic form re-raised as a ConfigError naming it and the way out."""
    cudnn, on = torch.backends.cudnn, choice.wanted(dtype)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              cudnn.deterministic, cudnn.benchmark)
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before cuBLAS starts: its reproducible form
    torch.use_deterministic_algorithms(on)
    cudnn.deterministic, cudnn.benchmark = on, before[3] and not on
    try:
        yield on
    except RuntimeError as error:
        refused = REFUSED_OP.search(str(error))
        if not on or refused is None:
            raise
        raise ConfigError("--deterministic", f"{refused.group(1)} has no deterministic form in torch, and this run "
                                             f"uses torch's deterministic algorithms (on, or auto with --dtype "
                                             f"float64); pass --deterministic off (a CUDA rerun may then differ in "
                                             f"the last bits), or use a layer that has one") from error
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        cudnn.deterministic, cudnn.benchmark = before[2:]
