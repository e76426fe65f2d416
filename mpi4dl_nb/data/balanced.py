"""A class-balanced epoch order (``--balanced-sampler``): each class drawn equally often, within a class each group
(slide, patient) in turn, a pure function of the seed and the epoch, so every rank draws the same batches."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch


def cycled(items: Sequence[int], generator: torch.Generator) -> Iterator[int]:
    """``items`` over and over, each pass in a new random order drawn from ``generator``."""
    while True:
        yield from (items[i] for i in torch.randperm(len(items), generator=generator).tolist())


@dataclass(frozen=True)
class BalancedOrder:
    """The draw of ``labels`` grouped by ``groups`` (a name per image; ungrouped: each its own): an epoch as long as
    the data, its classes in blocks holding each class once (a random order per block), so a run of whole blocks
    (a batch of a multiple of the classes) holds each class equally; a class's groups in turn, a group's images in
    turn (each pass a new order), so a slide of many images weighs as much as one of few."""

    labels: tuple[int, ...]
    groups: tuple[str, ...]
    _epochs: dict[tuple[int, int], list[int]] = field(default_factory=dict, compare=False, repr=False)

    def epoch(self, seed: int, epoch: int) -> list[int]:
        """The image of each position of epoch ``epoch`` (seeded as the shuffled order is; the newest epoch kept)."""
        if (seed, epoch) not in self._epochs:
            self._epochs.clear()
            self._epochs[seed, epoch] = self.drawn(torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        return self._epochs[seed, epoch]

    def drawn(self, generator: torch.Generator) -> list[int]:
        classes = sorted(set(self.labels))
        members: dict[int, dict[str, list[int]]] = {c: {} for c in classes}
        for index, (label, group) in enumerate(zip(self.labels, self.groups, strict=True)):
            members[label].setdefault(group, []).append(index)

        def stream(groups: dict[str, list[int]]) -> Iterator[int]:
            inner = [cycled(images, generator) for images in groups.values()]
            return (next(inner[g]) for g in cycled(range(len(inner)), generator))

        streams = {c: stream(members[c]) for c in classes}
        blocks = [classes[i] for _ in range(-(-len(self.labels) // len(classes)))
                  for i in torch.randperm(len(classes), generator=generator).tolist()]
        return [next(streams[c]) for c in blocks[:len(self.labels)]]
