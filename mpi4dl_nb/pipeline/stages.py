"""Stages: a layer list cut into consecutive stages by a ``balance`` (``default_cut`` finds one)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .default_cut import check_balance, even_balance


class Stage(nn.Sequential):
    """Consecutive layers ``offset .. offset+len-1`` of the whole model, run in order.

    Like ``nn.Sequential`` each layer gets the previous layer's output, a tensor or a
    tuple; ``full_key`` maps this stage's state-dict keys to those of the whole model.
    """

    def __init__(self, layers: Sequence[nn.Module], offset: int, index: int = 0) -> None:
        super().__init__(*layers)
        self.offset = offset
        self.index = index

    def full_key(self, key: str) -> str:
        """``'0.weight'`` -> ``'<offset>.weight'``: the key in ``nn.Sequential(*layers)``."""
        local, _, rest = key.partition(".")
        return f"{int(local) + self.offset}.{rest}"

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state with whole-model keys (tensors detached, on CPU)."""
        return {self.full_key(k): v.detach().cpu().clone() for k, v in self.state_dict().items()}

    def load_from_full(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's entries of a whole-model state dict in place."""
        own = {k: state[self.full_key(k)] for k in self.state_dict() if self.full_key(k) in state}
        missing = [self.full_key(k) for k in self.state_dict() if self.full_key(k) not in state]
        if missing:
            raise KeyError(f"stage {self.index}: state dict lacks {missing[:4]}")
        with torch.no_grad():
            for key, value in self.state_dict(keep_vars=True).items():
                value.copy_(own[key].to(value.device, value.dtype))


def split_layers(layers: Sequence[nn.Module], split_size: int,
                 balance: Sequence[int] | None = None) -> list[Stage]:
    """Cut ``layers`` into ``split_size`` Stages (``balance`` layer counts, or even)."""
    layers = list(layers)
    counts = even_balance(len(layers), split_size) if balance is None else \
        check_balance(balance, len(layers), split_size)
    stages, offset = [], 0
    for index, count in enumerate(counts):
        stages.append(Stage(layers[offset:offset + count], offset, index))
        offset += count
    return stages
