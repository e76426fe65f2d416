"""Tensors' slices written into this member's slab of a node's window as backward accumulates them, and reused by
the sum that follows while the slab is still theirs: the one protocol of early writes (the tiles' gradient sums in
``spatial/node_reduction.py``, ZeRO's reduce-scatter in ``sharding/transports.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .node_sum import NodeSum

Place = tuple[int, int, int]   # (where in the slab, start, stop): a tensor's flat elements start:stop written there


class EarlyWrites:
    """Tensor ``i``'s flat elements ``start:stop`` written at ``at`` of this member's slab (``slab()``, a view made
    again when the window grew) for each of ``places[i]``: as each arrives (``write``, from a post-accumulate hook)
    and, just before the sum, again for whatever never came or changed since (``refresh``). The writes stand while
    this owner holds ``node``'s claim (``NodeSum.holder``): another sum over the same window, or its growth, drops
    it, and every tensor is written again."""

    def __init__(self, node: NodeSum, places: Sequence[Sequence[Place]], slab: Callable[[], torch.Tensor]) -> None:
        self.node, self.slab = node, slab
        self.places = [list(found) for found in places]
        self.copied: dict[int, tuple[torch.Tensor, int]] = {}   # tensor index -> (the tensor written, its version)

    def _claim(self) -> None:
        if self.node.holder is not self:
            self.copied.clear()
            self.node.holder = self

    def write(self, index: int, tensor: torch.Tensor | None) -> None:
        """Tensor ``index``'s slices into the slab now (None: zeros in their places)."""
        self._claim()
        slab = self.slab()
        flat = None if tensor is None else tensor.detach().reshape(-1)
        for at, start, stop in self.places[index]:
            target = slab[at:at + stop - start]
            if flat is None:
                target.zero_()
            else:
                target.copy_(flat[start:stop])
        if tensor is None:
            self.copied.pop(index, None)
        else:
            self.copied[index] = (tensor, tensor._version)

    def refresh(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Before the sum of ``tensors``: write each one not in the slab as it is now (another tensor, changed since,
        never written, the claim lost), then forget them all (the sum follows; the next pass writes anew)."""
        self._claim()
        for index, tensor in enumerate(tensors):
            seen = self.copied.get(index)
            if seen is None or tensor is not seen[0] or tensor is None or tensor._version != seen[1]:
                self.write(index, tensor)
        self.copied.clear()
