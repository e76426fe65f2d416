"""A class-balanced epoch order (``--balanced-sampler``): each class drawn equally often, and within a class each
group (slide, patient) in turn, a pure function of the seed and the epoch, so every rank draws the same batches."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

EPOCH_SEED = 1_000_003          # the epoch's generator: seed * EPOCH_SEED + epoch, as the shuffled order's


def cycled(items: Sequence[int], generator: torch.Generator) -> Iterator[int]:
    """``items`` over and over, each pass in a new random order drawn from ``generator``."""
    while True:
        for position in torch.randperm(len(items), generator=generator).tolist():
            yield items[position]


def class_stream(members: dict[str, list[int]], generator: torch.Generator) -> Iterator[int]:
    """A class's images: its groups in turn (each pass a new order), within a group its images in turn (each its own
    passes), so a slide or patient of many images weighs as much as one of few."""
    names = list(members)
    inner = {name: cycled(members[name], generator) for name in names}
    for position in cycled(range(len(names)), generator):
        yield next(inner[names[position]])


@dataclass(frozen=True)
class BalancedOrder:
    """The draw of ``labels`` (one per image) grouped by ``groups`` (one name per image; ungrouped: each image's
    own): an epoch is as long as the data, its classes in blocks holding each class once (a random order per block),
    so any run of whole blocks, a batch of a multiple of the classes included, holds every class equally."""

    labels: tuple[int, ...]
    groups: tuple[str, ...]
    _epochs: dict[tuple[int, int], list[int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.groups) or not self.labels:
            raise ValueError(f"{len(self.labels)} labels for {len(self.groups)} groups: one of each per image")

    def epoch(self, seed: int, epoch: int) -> list[int]:
        """The image of each position of epoch ``epoch`` (as many as images; the newest epoch kept)."""
        key = (seed, epoch)
        if key not in self._epochs:
            self._epochs.clear()
            self._epochs[key] = self.drawn(torch.Generator().manual_seed(seed * EPOCH_SEED + epoch))
        return self._epochs[key]

    def drawn(self, generator: torch.Generator) -> list[int]:
        """One epoch drawn from ``generator``: the class of each position, then the next image of that class."""
        classes = sorted(set(self.labels))
        members: dict[int, dict[str, list[int]]] = {c: {} for c in classes}
        for index, (label, group) in enumerate(zip(self.labels, self.groups, strict=True)):
            members[label].setdefault(group, []).append(index)
        streams = {c: class_stream(members[c], generator) for c in classes}
        blocks = -(-len(self.labels) // len(classes))
        order = [classes[i] for _ in range(blocks) for i in torch.randperm(len(classes), generator=generator).tolist()]
        return [next(streams[c]) for c in order[:len(self.labels)]]
