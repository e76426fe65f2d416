"""Memory planner: per-rank memory estimate of a configuration from layer shapes, and ``suggest``.

Model of one rank's peak (bytes):

* **state**: for every stage slot the rank holds (primary, and the GEMS mirror's own
  weights), parameters + gradients + ``optimizer_states`` copies (SGD momentum 1, Adam 2);
* **activations**: tensors autograd saves for backward, per sample, profiled once on the
  ``meta`` device (no real memory, any image size), plus the stage output held until its
  backward, plus on spatial stages the halo'd input copy every conv/pool saves; scaled by
  the chunk size and, for spatial stages, the largest tile's share of the image (plus its
  halo). How many chunks
  are alive at once is read off the real schedule (``schedules.build_schedule``): each
  F adds its chunk, each B removes it, the peak of the running sum counts;
* **transient**: the largest layer output of the rank's stages twice (output and its
  gradient in flight during backward) times the chunk size, plus the received hand-off
  buffer, plus every input gradient sent back during the step (non-blocking sends keep
  them referenced until the optimizer step).

``measure_peak_bytes`` measures the same quantity for a real step (CPU: the PyTorch
profiler's allocation record; CUDA: the caching allocator's peak), so estimate and
measurement can be compared side by side (tests/test_planner.py, benchmarks/bench_planner.py).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...comm.messages import as_items
from ...config import ConfigError, ParallelConfig, SliceMethod
from ...layout import layout
from ...pipeline.schedules import Action, ActionKind, build_schedule
from ...pipeline.stages import check_balance, even_balance, layer_memory
from ...run.metrics import state_bytes, tensor_bytes

Layers = Sequence[nn.Module] | nn.Sequential


@dataclass(frozen=True)
class LayerProfile:
    """One layer at batch 1 on the full image: shapes, bytes saved for backward, cost."""

    index: int
    name: str
    out_shapes: tuple[tuple[int, ...], ...]
    param_bytes: int
    saved_bytes: int          # per sample, activations only (parameters excluded)
    out_bytes: int            # per sample
    flops: float              # per sample, forward multiply-adds x 2 (convs, linears) + elementwise
    spatial_dims: tuple[int, int] | None   # output (H, W) if the output is a feature map
    window_in_bytes: int = 0  # per sample, inputs of convs/pools with a window > 1 (halo'd copies)


@dataclass(frozen=True)
class RankMemory:
    """Estimated peak bytes of one rank, by kind."""

    rank: int
    role: str
    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "role": self.role, "params": self.params, "grads": self.grads,
                "optimizer": self.optimizer, "activations": self.activations,
                "transient": self.transient, "total": self.total}


@dataclass
class MemoryPlan:
    """The estimate of one configuration: per-rank memory plus what it was computed from."""

    cfg: ParallelConfig
    batch_size: int
    image_size: tuple[int, int]
    balance: tuple[int, ...]
    ranks: list[RankMemory]
    chunk_samples: int

    @property
    def totals(self) -> list[int]:
        return [r.total for r in self.ranks]

    @property
    def peak(self) -> int:
        return max(self.totals)

    def table(self) -> str:
        """Aligned text table in MB."""
        mb = 2 ** 20
        lines = [f"{'rank':>4}  {'role':<22}{'params':>8}{'grads':>8}{'optim':>8}"
                 f"{'activ':>9}{'trans':>8}{'total':>9}  (MB)"]
        for r in self.ranks:
            lines.append(f"{r.rank:>4}  {r.role:<22}{r.params / mb:8.2f}{r.grads / mb:8.2f}"
                         f"{r.optimizer / mb:8.2f}{r.activations / mb:9.2f}"
                         f"{r.transient / mb:8.2f}{r.total / mb:9.2f}")
        return "\n".join(lines)


# --------------------------------------------------------------------- layer profiling
def _as_list(model: Layers) -> list[nn.Module]:
    if isinstance(model, nn.Sequential):
        return list(model.children())
    layers = list(model)
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise ValueError("model must be a non-empty list of nn.Module layers (or nn.Sequential)")
    return layers


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in as_items(value) if isinstance(t, torch.Tensor)]


def _flop_hooks(model: nn.Module, counter: list[float]) -> list[RemovableHandle]:
    """Hooks adding ``model``'s forward FLOPs to ``counter[0]`` and the bytes of the inputs
    of its windowed convs/pools (window > 1) to ``counter[1]``."""
    def conv_hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        k = math.prod(module.kernel_size) * module.in_channels // module.groups
        counter[0] += 2.0 * output.numel() * k

    def linear_hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        counter[0] += 2.0 * output.numel() * module.in_features

    def other_hook(module: nn.Module, inputs: Any, output: Any) -> None:
        if not list(module.children()):
            counter[0] += float(sum(t.numel() for t in _tensors(output)))

    def window_hook(module: nn.Module, inputs: Any, output: Any) -> None:
        kernel = module.kernel_size if isinstance(module.kernel_size, tuple) else (module.kernel_size,)
        if any(k > 1 for k in kernel):
            counter[1] += float(sum(tensor_bytes(t) for t in _tensors(inputs)))

    handles = []
    for sub in model.modules():
        if isinstance(sub, (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd,
                            nn.modules.pooling._AvgPoolNd)):
            handles.append(sub.register_forward_hook(window_hook))
        if isinstance(sub, nn.modules.conv._ConvNd):
            handles.append(sub.register_forward_hook(conv_hook))
        elif isinstance(sub, nn.Linear):
            handles.append(sub.register_forward_hook(linear_hook))
        else:
            handles.append(sub.register_forward_hook(other_hook))
    return handles


def profile_layers(model: Layers, image_size: int | tuple[int, int], in_channels: int = 3,
                   dtype: torch.dtype = torch.float32) -> list[LayerProfile]:
    """Per-layer shapes, saved-for-backward bytes and FLOPs at batch 1 (on the meta device).

    Saved bytes follow ``pipeline.stages.layer_memory``'s counting rule (shared with
    ``auto_balance(by="memory")``): parameters excluded, a tensor saved by two layers (a
    ReLU output that the next conv also saves) counted once, for the first layer that saved it.
    """
    layers = _as_list(model)
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    sample = torch.empty(1, in_channels, height, width, device="meta", dtype=dtype)
    counters = [[0.0, 0.0] for _ in layers]      # per layer: FLOPs, windowed-input bytes
    memory = layer_memory(layers, sample, dtype=dtype,
                          instrument=lambda index, layer: _flop_hooks(layer, counters[index]))
    profiles = []
    for index, (layer, mem, (flops, window_in)) in enumerate(zip(layers, memory, counters)):
        first = mem.outputs[0] if mem.outputs else None
        dims = (int(first.shape[-2]), int(first.shape[-1])) if first is not None and first.dim() == 4 \
            else None
        profiles.append(LayerProfile(
            index, type(layer).__name__, tuple(tuple(t.shape) for t in mem.outputs),
            mem.param_bytes, mem.saved_bytes, sum(tensor_bytes(t) for t in mem.outputs), flops, dims,
            int(window_in)))
    return profiles


# ---------------------------------------------------------------------- the estimate
def _balance(cfg: ParallelConfig, num_layers: int) -> tuple[int, ...]:
    if cfg.balance is not None:
        return check_balance(cfg.balance, num_layers, cfg.split_size)
    return even_balance(num_layers, cfg.split_size)


def _tile_share(cfg: ParallelConfig, height: int, width: int, halo: int) -> float:
    """Largest tile's area (with ``halo`` pixels on inner sides) over the image area."""
    rows, cols = cfg.grid_shape
    tile_h = math.ceil(height / rows) + (2 * halo if rows > 1 else 0)
    tile_w = math.ceil(width / cols) + (2 * halo if cols > 1 else 0)
    return min(1.0, tile_h * tile_w / (height * width))


def _live_chunks(cfg: ParallelConfig, rank_actions: Sequence[Action]) -> list[list[tuple[int, int]]]:
    """For each moment of a rank's action list: the (stage, replica) of every chunk alive."""
    alive: dict[tuple[int, int, int, int], tuple[int, int]] = {}
    moments = []
    for action in rank_actions:
        key = (action.stage, action.replica, action.micro_batch, action.copy)
        if action.kind is ActionKind.FORWARD:
            alive[key] = (action.stage, action.replica)
            moments.append(list(alive.values()))
        elif action.kind is ActionKind.BACKWARD:
            moments.append(list(alive.values()))
            alive.pop(key, None)
    return moments or [[]]


def estimate_memory(model: Layers | Sequence[LayerProfile], cfg: ParallelConfig,
                    image_size: int | tuple[int, int], batch_size: int, *,
                    in_channels: int = 3, dtype: torch.dtype = torch.float32,
                    optimizer_states: int = 1, halo: int = 1) -> MemoryPlan:
    """Per-rank peak memory estimate of ``cfg`` training ``model`` on ``batch_size`` images.

    ``model`` is a layer list (profiled here) or the output of :func:`profile_layers`.
    ``optimizer_states``: tensors per parameter the optimizer keeps (SGD momentum 1,
    plain SGD 0, Adam 2). ``halo``: pixels of halo per inner tile side (3x3 convs: 1).
    """
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    profiles = (list(model) if model and isinstance(list(model)[0], LayerProfile)
                else profile_layers(model, (height, width), in_channels, dtype))
    cfg.validate(batch_size=batch_size, num_layers=len(profiles))
    balance = _balance(cfg, len(profiles))
    bounds = list(itertools.accumulate((0,) + balance))
    stage_layers = [profiles[bounds[s]:bounds[s + 1]] for s in range(cfg.split_size)]
    chunk = batch_size // cfg.batch_divisor
    share = _tile_share(cfg, height, width, halo) if cfg.spatial_size > 0 else 1.0

    def stage_share(stage: int) -> float:
        return share if stage < cfg.spatial_size else 1.0

    # Per live chunk: what autograd saves, the stage output held until its backward (not
    # for the last stage: its output is the loss) and, on spatial stages, the halo'd copy
    # of every windowed layer's input that the tile's convs/pools save.
    last = cfg.split_size - 1
    act_bytes = [(sum(p.saved_bytes for p in layers)
                  + (layers[-1].out_bytes if s < last else 0)
                  + (sum(p.window_in_bytes for p in layers) if s < cfg.spatial_size else 0))
                 * chunk * stage_share(s)
                 for s, layers in enumerate(stage_layers)]
    biggest_out = [max(p.out_bytes for p in layers) * chunk * stage_share(s)
                   for s, layers in enumerate(stage_layers)]
    # Input arriving from the previous stage (hand-off gathers the whole map) + its gradient.
    handoff = [0.0] + [stage_layers[s - 1][-1].out_bytes * chunk for s in range(1, cfg.split_size)]
    param_bytes = [sum(p.param_bytes for p in layers) for layers in stage_layers]
    schedule = build_schedule(cfg)
    ranks = []
    for role in layout(cfg):
        slots = [role.primary] + ([role.mirror] if role.mirror is not None else [])
        params = sum(param_bytes[slot.stage] for slot in slots)
        peak_act = max(sum(act_bytes[stage] for stage, _ in moment)
                       for moment in _live_chunks(cfg, schedule.actions(role.rank)))
        # Gradients sent back to the previous stage stay referenced by their non-blocking
        # sends until the step's end: one input-sized buffer per chunk this rank ran.
        backwards = Counter(a.stage for a in schedule.actions(role.rank)
                            if a.kind is ActionKind.BACKWARD)
        sent = sum(handoff[stage] * count for stage, count in backwards.items())
        transient = max(2 * biggest_out[slot.stage] + handoff[slot.stage] for slot in slots) + sent
        ranks.append(RankMemory(role.rank, role.describe(), params, params,
                                params * optimizer_states, int(peak_act), int(transient)))
    return MemoryPlan(cfg, batch_size, (height, width), balance, ranks, chunk)


# ------------------------------------------------------------------------ measurement
def _profiler_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            events = json.load(handle).get("traceEvents", [])
    totals = [e["args"].get("Total Allocated", 0) for e in events
              if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0]
    return result, max([0] + totals)


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """Run ``fn()``; return (its result, peak bytes allocated during it above the start).

    CPU: the PyTorch profiler's allocation record (so glibc keeping freed memory does not
    matter); CUDA: ``torch.cuda.max_memory_allocated`` minus the bytes live at the start.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - start
    return _profiler_peak(fn)


def measure_step_memory(step: Callable[[], Any], modules: Iterable[nn.Module], optimizer: Any = None,
                        device: torch.device | str = "cpu") -> int:
    """Measured peak of one training step, comparable to ``RankMemory.total``.

    Gradients are set to None first (the estimate counts them as allocated in the step),
    then: bytes resident before (parameters + optimizer state) + peak allocated during.
    """
    modules = list(modules)
    for module in modules:
        module.zero_grad(set_to_none=True)
    resident = state_bytes([p for m in modules for p in m.parameters()], optimizer)
    _, peak = measure_peak_bytes(step, device)
    return resident + peak


# --------------------------------------------------------------------------- suggest
@dataclass(frozen=True)
class Suggestion:
    """A valid configuration that fits, with its estimated peak and relative speed."""

    cfg: ParallelConfig
    world_size: int
    peak_bytes: int
    est_step_time: float     # FLOPs on the critical path (communication not modelled)
    speedup: float           # estimated step-time ratio against one device

    def describe(self) -> str:
        c = self.cfg
        return (f"{self.world_size} ranks: split {c.split_size} spatial {c.spatial_size} x "
                f"{c.num_spatial_parts} {c.slice_method}, parts {c.parts}, local_dp "
                f"{c.local_dp}, dp {c.data_parallel}{', GEMS' if c.gems else ''}: peak "
                f"{self.peak_bytes / 2 ** 20:.1f} MB, est. speedup {self.speedup:.2f}x")


def _step_time(profiles: Sequence[LayerProfile], cfg: ParallelConfig, balance: Sequence[int],
               batch_size: int) -> float:
    """Critical-path FLOPs of one step: slowest stage per chunk x pipeline length (fwd+bwd=3x)."""
    bounds = list(itertools.accumulate((0,) + tuple(balance)))
    chunk = batch_size // cfg.batch_divisor
    per_stage = []
    for s in range(cfg.split_size):
        flops = sum(p.flops for p in profiles[bounds[s]:bounds[s + 1]]) * 3 * chunk
        if s < cfg.spatial_size:
            flops = flops / cfg.num_spatial_parts * cfg.local_dp   # tiles run every copy's chunk
        per_stage.append(flops)
    chunks_per_rank = cfg.parts * (2 * cfg.times if cfg.gems else 1)
    return max(per_stage) * (chunks_per_rank + cfg.split_size - 1)


def candidate_configs(devices: int, num_layers: int, batch_size: int,
                      max_split: int = 4) -> list[ParallelConfig]:
    """Every valid configuration on at most ``devices`` ranks (square/vertical/horizontal)."""
    divisors = [p for p in range(1, batch_size + 1) if batch_size % p == 0]
    found = []
    for split in range(1, min(max_split, num_layers, devices) + 1):
        # The classifier head (global pool + linear) always sits in a layer-parallel stage.
        for spatial in range(0, split):
            if spatial == 0:
                spatial_options = [(4, SliceMethod.SQUARE)]
            else:
                spatial_options = [(p, m) for p in range(2, devices + 1) for m in SliceMethod]
            local_dps = range(1, devices + 1)
            for (num_parts, method), local_dp, parts, times, dp in itertools.product(
                    spatial_options, local_dps, divisors, (0, 1), range(1, devices + 1)):
                try:
                    cfg = ParallelConfig(split_size=split, spatial_size=spatial,
                                         num_spatial_parts=num_parts, slice_method=method,
                                         parts=parts, times=times, local_dp=local_dp,
                                         data_parallel=dp)
                    if cfg.world_size > devices:
                        continue
                    cfg.validate(batch_size=batch_size, num_layers=num_layers)
                except ConfigError:
                    continue
                found.append(cfg)
    return list(dict.fromkeys(found))


def suggest(model: Layers, image_size: int | tuple[int, int], memory_per_device: float,
            devices: int, *, batch_size: int = 1, in_channels: int = 3,
            dtype: torch.dtype = torch.float32, optimizer_states: int = 1,
            top: int | None = 10, max_split: int = 4) -> list[Suggestion]:
    """Valid configurations on at most ``devices`` ranks whose every rank fits in
    ``memory_per_device`` bytes, fastest first (estimated speedup over one device from
    critical-path FLOPs; communication is not modelled; ties: fewer ranks, then lower
    peak). Raises ValueError naming what to change if none fits.
    """
    if devices < 1:
        raise ValueError(f"devices={devices}: need at least 1")
    profiles = profile_layers(model, image_size, in_channels, dtype)
    serial_cfg = ParallelConfig(split_size=1, spatial_size=0)
    serial_time = _step_time(profiles, serial_cfg, (len(profiles),), batch_size)
    ranked = []
    for cfg in candidate_configs(devices, len(profiles), batch_size, max_split):
        try:
            plan = estimate_memory(profiles, cfg, image_size, batch_size,
                                   optimizer_states=optimizer_states)
        except ConfigError:
            continue
        if plan.peak > memory_per_device:
            continue
        time = _step_time(profiles, cfg, plan.balance, batch_size)
        ranked.append(Suggestion(cfg, cfg.world_size, plan.peak, time,
                                 serial_time / time if time else float("inf")))
    if not ranked:
        serial = estimate_memory(profiles, serial_cfg, image_size, batch_size, optimizer_states=optimizer_states)
        raise ValueError(f"no configuration on {devices} devices fits memory_per_device="
                         f"{memory_per_device / 2 ** 20:.1f} MB (one device needs "
                         f"{serial.peak / 2 ** 20:.1f} MB); raise devices or memory_per_device, "
                         f"or lower batch_size/image_size")
    ranked.sort(key=lambda s: (-round(s.speedup, 6), s.world_size, s.peak_bytes))
    return ranked[:top] if top else ranked


def measure_engine_step(engine: Any, images: Any, labels: Any, warmup: int = 1) -> int:
    """This rank's measured peak for one ``HybridEngine.train_step`` (after ``warmup`` steps,
    so optimizer state exists); comparable to the planner's ``RankMemory.total``."""
    for _ in range(warmup):
        engine.train_step(images, labels)
    modules = [inst.canonical for inst in engine.instances.values()]
    device = getattr(engine.ctx, "device", "cpu")
    return measure_step_memory(lambda: engine.train_step(images, labels), modules,
                               engine.optimizer, device)
