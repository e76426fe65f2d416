"""A recording stand-in for the device the planner measures on (``planner.device.MeasuringDevice``):
layer times from sizes and a fixed copy speed, nothing run, every measurement recorded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mpi4dl_nb.planner.device import LayerTime, TimingRequest
from mpi4dl_nb.planner.layer_timer import LayerTimer


@dataclass(eq=False)
class RecordingDevice:
    """Stands in for device ``name`` (a GPU's cores: None; a CPU's: ``cpu_cores``): a layer takes
    100 ns per input element (forward; twice that backward) on its tile, a copy runs at
    ``bandwidth``; ``measurements`` holds (what, device, how many) of every measurement asked."""

    name: str = "cpu"
    cpu_cores: int = 2
    bandwidth: float = 1e10
    measurements: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    def time_layers(self, pending: Sequence[tuple[TimingRequest, int]], repeats: int,
                    threads: int) -> list[LayerTime]:
        self.measurements.append(("layers", str(self.device), len(pending)))
        return [flops(request) for request, _ in pending]

    def copy_bandwidth(self) -> float:
        self.measurements.append(("copy", str(self.device), 1))
        return self.bandwidth

    def cores(self) -> int | None:
        return self.cpu_cores if self.device.type == "cpu" else None

    @property
    def layer_batches(self) -> list[int]:
        """How many layers each layer measurement timed."""
        return [count for what, _, count in self.measurements if what == "layers"]


def flops(request: TimingRequest) -> LayerTime:
    """A layer's deterministic 'time': 100 ns per input element on its tile forward, 200 backward."""
    pixels = sum(torch.Size(s).numel() for s in request.shapes) / (request.role.tiles if request.role.grid else 1)
    return LayerTime(pixels * 1e-9 * 100, pixels * 2e-9 * 100)


def flop_timer(device: str = "cpu") -> LayerTimer:
    """A LayerTimer answering from sizes (``flops``) on a recording stand-in for ``device``."""
    return LayerTimer(RecordingDevice(device))
