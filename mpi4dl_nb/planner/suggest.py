"""``suggest``: every valid configuration for a world size, those that fit ranked by predicted time.

Configurations are enumerated in a canonical form, so no two rows are the same run: knobs
that do nothing are left at their defaults (no spatial stage: no slice method or tile
count; one stage: copies are data parallelism, no micro-batch schedule; one micro-batch:
GPipe). Each is checked by the memory model against the per-rank limit, the fitting ones
are timed by the time model and ranked; every row says in one line what binds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch

from ..config import ConfigError, ParallelConfig, ScheduleKind, SliceMethod
from ..layout import stage_holders
from ..pipeline.default_cut import draws_in_training
from ..pipeline.stage_draws import draws_refusal
from .device import MeasuringDevice
from .exchanges import StageExchanges, config_exchanges
from .layer_timer import LayerTimer, measuring_device
from .memory import MB, LossFn, MemoryPlan, Precision, Recompute, default_loss, estimate_memory
from .optimizer import OptimizerFactory
from .profile import LayerProfile, Layers, profile_layers
from .step_time import StepModel, TimePlan, step_model, time_layers
from .timing import Network, Node


def describe_config(cfg: ParallelConfig) -> str:
    """The configuration in words, only the knobs that matter (no 'spatial 0 x 4')."""
    parts = []
    if cfg.spatial_size:
        rows, cols = cfg.grid_shape
        tiles = f"{rows}x{cols}" + (f" {cfg.slice_method}" if cfg.grid is None else "")
        parts.append(f"SP {tiles} on {cfg.spatial_size} stage{'s' if cfg.spatial_size > 1 else ''}")
        if cfg.halo_d2:
            parts.append(f"halo-D2 x{cfg.fused_layers}")
    lp = cfg.split_size - cfg.spatial_size
    if cfg.split_size > 1:
        parts.append(f"LP {lp} stage{'s' if lp > 1 else ''}")
    else:
        parts.append("1 stage")
    if cfg.local_dp > 1:
        parts.append(f"local DP x{cfg.local_dp}")
    if cfg.parts > 1:
        parts.append(f"{cfg.parts} micro-batches ({cfg.schedule})")
    if cfg.virtual_stages > 1:
        parts.append(f"{cfg.virtual_stages} chunks per rank")
    if cfg.gems:
        parts.append(f"GEMS x{cfg.times}")
    if cfg.data_parallel > 1:
        parts.append(f"DP x{cfg.data_parallel}")
    if cfg.zero_stage:
        parts.append(f"ZeRO {cfg.zero_stage}")
    if cfg.balance is not None:
        parts.append(f"balance {list(cfg.balance)}")
    return " + ".join(parts)


def canonical(cfg: ParallelConfig) -> ParallelConfig:
    """``cfg`` with the knobs that change nothing at their defaults."""
    changes: dict[str, object] = {}
    if cfg.spatial_size == 0:
        changes.update(num_spatial_parts=4, slice_method=SliceMethod.SQUARE, halo_d2=False,
                       fused_layers=1, grid=None)
    if cfg.split_size == 1 and cfg.local_dp > 1:      # copies of the only stage = data parallelism
        changes.update(local_dp=1, data_parallel=cfg.data_parallel * cfg.local_dp)
    if cfg.parts == 1 or cfg.split_size == 1:
        changes.update(schedule=ScheduleKind.GPIPE)
    if cfg.zero_stage and all(len(stage_holders(cfg, s)) == 1 for s in range(cfg.split_size)):
        changes.update(zero_stage=0)                 # no stage shared: nothing to shard
    return cfg.with_(**changes) if changes else cfg


CHUNKED_SCHEDULES = (ScheduleKind.INTERLEAVED, ScheduleKind.ZBV)   # several stages (chunks) per rank


def candidate_configs(devices: int, num_layers: int, batch_size: int, *, max_split: int = 4,
                      exact: bool = True, max_times: int = 1) -> list[ParallelConfig]:
    """Every valid canonical configuration on ``devices`` ranks (at most, if not ``exact``)."""
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]

    def options() -> Iterator[ParallelConfig]:
        for split in range(1, min(max_split, num_layers, devices) + 1):
            for spatial in range(0, split):   # the classifier always sits in a layer-parallel stage
                grids: list[tuple[int, SliceMethod]] = [(4, SliceMethod.SQUARE)]
                if spatial:
                    grids = [(p, m) for p in range(2, devices + 1) for m in SliceMethod
                             if m is not SliceMethod.SQUARE or math.isqrt(p) ** 2 == p]
                for (tiles, method), local_dp, parts, times, dp in itertools.product(
                        grids, range(1, devices + 1), divisors, range(0, max_times + 1),
                        range(1, devices + 1)):
                    # every schedule, zb1/zbv too (the time model costs their I and W: step_time.py)
                    schedules = list(ScheduleKind) if parts > 1 and split > 1 else [ScheduleKind.GPIPE]
                    for schedule in schedules:
                        # interleaved, zbv: `split` ranks along the pipeline, each holding 2 chunks
                        chunks = 2 if schedule in CHUNKED_SCHEDULES else 1
                        try:
                            cfg = ParallelConfig(split_size=split * chunks, spatial_size=spatial,
                                                 num_spatial_parts=tiles, slice_method=method,
                                                 parts=parts, times=times, local_dp=local_dp,
                                                 data_parallel=dp, schedule=schedule, virtual_stages=chunks)
                        except ConfigError:
                            continue
                        yield cfg

    found: dict[ParallelConfig, None] = {}
    for cfg in options():
        if cfg.world_size > devices or (exact and cfg.world_size != devices):
            continue
        try:
            cfg.validate(batch_size=batch_size, num_layers=num_layers)
        except ConfigError:
            continue
        found.setdefault(canonical(cfg), None)
    return list(found)


KnobValue = int | SliceMethod | ScheduleKind    # a value ``one_knob_variants`` tries (bool knobs are ints)

KNOB_VALUES: dict[str, Callable[[int, int], list[KnobValue]]] = {
    # knob -> its values to try, from (devices, batch_size)
    "split_size": lambda devices, batch: list(range(1, devices + 1)),
    "spatial_size": lambda devices, batch: list(range(0, devices)),
    "num_spatial_parts": lambda devices, batch: list(range(2, devices + 1)),
    "slice_method": lambda devices, batch: list(SliceMethod),
    "parts": lambda devices, batch: [d for d in range(1, batch + 1) if batch % d == 0],
    "schedule": lambda devices, batch: list(ScheduleKind),
    "local_dp": lambda devices, batch: list(range(1, devices + 1)),
    "times": lambda devices, batch: [0, 1],
    "data_parallel": lambda devices, batch: list(range(1, devices + 1)),
    "halo_d2": lambda devices, batch: [False, True],
}


def one_knob_variants(base: ParallelConfig, num_layers: int, batch_size: int,
                      knobs: Sequence[str] = tuple(KNOB_VALUES)) -> list[tuple[str, KnobValue, ParallelConfig]]:
    """Every valid configuration on ``base``'s ranks that differs from ``base`` in exactly one
    knob of ``knobs``, as (knob, value, config): a sweep where each row changes one thing
    (changes that make no difference, e.g. a schedule with one micro-batch, are left out)."""
    base = canonical(base)
    found: list[tuple[str, KnobValue, ParallelConfig]] = []
    seen = {base}
    for knob in knobs:
        for value in KNOB_VALUES[knob](base.world_size, batch_size):
            if value == getattr(base, knob):
                continue
            try:
                cfg = base.with_(**{knob: value})
                cfg.validate(world_size=base.world_size, batch_size=batch_size, num_layers=num_layers)
            except ConfigError:
                continue
            cfg = canonical(cfg)
            if cfg not in seen:
                seen.add(cfg)
                found.append((knob, value, cfg))
    return found


@dataclass(frozen=True)
class Suggestion:
    """A configuration that fits, its predicted memory and time, and what binds it."""

    cfg: ParallelConfig
    world_size: int
    peak_bytes: int
    est_step_time: float          # predicted seconds per step
    speedup: float                # predicted one-process step time / this one
    memory: MemoryPlan
    time: TimePlan
    exchanges: StageExchanges | None = None   # the spatial stage's attention exchanges (families' cost models)

    @property
    def images_per_second(self) -> float:
        return self.time.images_per_second

    def why(self) -> str:
        """One line: the memory that binds and what limits the speed."""
        rank = self.memory.binding_rank
        return (f"largest rank {rank.rank} ({rank.role}) {rank.total / MB:.1f} MB (training state "
                f"{rank.state_bytes / MB:.1f}); time bound by {self.time.binding()}")

    def describe(self) -> str:
        exchanged = "" if not self.exchanges or not self.exchanges.exchanges else (
            f", attention exchanges {self.exchanges.sent / MB:.2f} MB/tile/sample")
        return (f"{self.world_size} ranks: {describe_config(self.cfg)}: peak {self.peak_bytes / MB:.1f} MB, "
                f"{self.est_step_time:.3f} s/step, {self.speedup:.2f}x one process{exchanged} - {self.why()}")


HEADROOM = 0.08   # share of the limit a suggestion leaves free: the estimate runs up to 7% under the measured peak


@dataclass(frozen=True)
class Refusal:
    """A valid configuration that does not fit the memory limit (less the headroom), and why."""

    cfg: ParallelConfig
    memory: MemoryPlan
    limit: float
    headroom: float = 0.0

    def why(self) -> str:
        rank = self.memory.binding_rank
        budget = self.limit * (1 - self.headroom)
        kept = f" ({self.limit / MB:.1f} MB less {self.headroom:.0%} headroom)" if self.headroom else ""
        return (f"rank {rank.rank} ({rank.role}) needs {rank.total / MB:.1f} MB (training state "
                f"{rank.state_bytes / MB:.1f}) > {budget / MB:.1f} MB{kept}")

    def describe(self) -> str:
        return f"{self.cfg.world_size} ranks: {describe_config(self.cfg)}: refused - {self.why()}"


TOSS_UP = 0.10     # predicted this close to the first: only a measurement tells them apart


class Suggestions(list[Suggestion]):
    """``suggest``'s ranked Suggestions (a list), with the refused configurations and the
    one-process reference (``serial_memory``, ``serial_time``)."""

    refused: list[Refusal]
    serial_memory: MemoryPlan
    serial_time: TimePlan | None

    def toss_up(self, within: float = TOSS_UP) -> int:
        """How many of the first suggestions are predicted within ``within`` (a share) of the
        first: closer than the time model's error on shared cores, so only measuring them
        (the live auto-tune) can tell them apart. 0 without suggestions."""
        if not self:
            return 0
        first = self[0].est_step_time
        return sum(1 for s in self if s.est_step_time <= first * (1 + within))

    def table(self, refused: bool = True) -> str:
        """Ranked rows (a note when the first ones are a toss-up), then the refused ones (one line each)."""
        lines = [f"one process: peak {self.serial_memory.peak / MB:.1f} MB"
                 + (f", {self.serial_time.seconds:.3f} s/step" if self.serial_time else "")]
        lines += [f"{i + 1:2d}. {s.describe()}" for i, s in enumerate(self)]
        close = self.toss_up()
        if close > 1:
            lines.append(f"    the first {close} are predicted within {TOSS_UP:.0%} of each other, closer than "
                         f"the step-time model's error where ranks share cores: measure them "
                         f"(AutoTune, python -m mpi4dl_nb tune) to pick")
        if refused:
            lines += [f"  x  {r.describe()}" for r in self.refused]
        return "\n".join(lines)


class SuggestOptions(TypedDict, total=False):
    """``suggest``'s keyword options besides the ones a live auto-tune sets itself (``Tuner``'s
    network, device, top, threads, batch size and dtype)."""

    in_channels: int
    precision: Precision | None
    recompute: Recompute | str | None
    optimizer: OptimizerFactory | None
    optimizer_states: int | None
    loss_fn: LossFn
    node: Node | None
    timer: LayerTimer | None
    max_split: int
    exact: bool
    max_times: int
    headroom: float
    zero_stages: Sequence[int]


def suggest(model: Layers, image_size: int | tuple[int, int], memory_per_device: float,
            devices: int, *, batch_size: int = 1, in_channels: int = 3,
            dtype: torch.dtype = torch.float32, precision: Precision | None = None,
            recompute: Recompute | str | None = None, optimizer: OptimizerFactory | None = None,
            optimizer_states: int | None = None,
            loss_fn: LossFn = default_loss,
            network: Network | None = None, device: MeasuringDevice | torch.device | str = "auto",
            node: Node | None = None, timer: LayerTimer | None = None,
            threads: int | None = None, top: int | None = 10, max_split: int = 4, exact: bool = True,
            max_times: int = 1, headroom: float = HEADROOM, zero_stages: Sequence[int] = (0,)) -> Suggestions:
    """Configurations on ``devices`` ranks (exactly; ``exact=False``: at most) whose every
    rank fits ``memory_per_device`` bytes less ``headroom`` (a share: the memory estimate runs
    up to 7% under the measured peak on spatial ranks, BENCHMARKS.md §6; 0 trusts it exactly),
    fastest predicted first (ties: fewer ranks, lower peak), at most ``top``. The result also
    lists what was refused (``.refused``) and the one-process reference. ValueError naming what
    to change if nothing fits.
    ``threads``: torch threads of each rank of the parallel configurations when they differ
    from ``dl.init``'s split of the node's cores (the one-process reference uses every core).
    ``device``: the job's device, where layer times and copy speed are measured (``step_model``;
    ``"auto"``: the one ``dl.init()`` would give this process); ``timer``/``node``, when given,
    say where instead. ``zero_stages``: the ZeRO stages (``--zero-stage``) a configuration may take, lowest
    first: each takes the lowest that fits (the time model does not cost ZeRO's gathers: docs/planner-models.md).
    """
    if devices < 1:
        raise ValueError(f"devices={devices}: need at least 1")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom}: a share of the limit, from 0 (none) to below 1")
    precision = precision or Precision(dtype)
    step = _StepEstimate(profile_layers(model, image_size, in_channels, precision.activations), image_size,
                         batch_size, precision, recompute, loss_fn, optimizer, optimizer_states, in_channels)
    serial_cfg = ParallelConfig(split_size=1, spatial_size=0)
    serial_memory = step.memory(serial_cfg)
    candidates = candidate_configs(devices, len(step.profiles), batch_size, max_split=max_split, exact=exact,
                                   max_times=max_times)
    fitting, refused = _by_memory(step, candidates, memory_per_device, headroom, zero_stages)
    if not fitting:
        kept = f" less {headroom:.0%} headroom" if headroom else ""
        drawn = step.draws() and devices > 1
        left = (" (those with dropout or stochastic depth on two stages or on replicas are left out: training "
                "refuses them; set the rates to 0 to weigh them too)") if drawn else ""
        raise ValueError(f"no configuration on {devices} devices fits memory_per_device="
                         f"{memory_per_device / MB:.1f} MB{kept}{left} (one device needs "
                         f"{serial_memory.peak / MB:.1f} MB); raise devices or memory_per_device, "
                         f"or lower batch_size/image_size")
    bench = timer.bench if timer else measuring_device(device)
    where = _Timing(network, node or Node.measured(bench), bench, timer)   # copy speed measured once, for all
    ranked, serial_time = _ranked(step, where, serial_cfg, fitting, threads)
    result = Suggestions(ranked[:top] if top else ranked)
    result.refused = sorted(refused, key=lambda r: r.memory.peak)
    result.serial_memory, result.serial_time = serial_memory, serial_time
    return result


@dataclass(frozen=True)
class _StepEstimate:
    """What every candidate's memory and time estimates share: the layers' profiles and the step's shape."""

    profiles: list[LayerProfile]
    image_size: int | tuple[int, int]
    batch_size: int
    precision: Precision
    recompute: Recompute | str | None
    loss_fn: LossFn
    optimizer: OptimizerFactory | None
    optimizer_states: int | None
    in_channels: int = 3

    def exchanges(self, cfg: ParallelConfig) -> StageExchanges | None:
        """The attention exchanges of ``cfg``'s spatial stage (None: none), as the conversion families cost them."""
        layers = [p.layer for p in self.profiles if p.layer is not None]
        if len(layers) < len(self.profiles):
            return None
        try:
            return config_exchanges(layers, cfg, self.image_size, self.in_channels,
                                    self.precision.activations.itemsize)
        except (ConfigError, ValueError, RuntimeError):    # a stage the memory model laid out but meta cannot run
            return None

    def draws(self) -> bool:
        """Whether a layer draws random numbers in training (dropout, stochastic depth)."""
        return any(draws_in_training([p.layer for p in self.profiles if p.layer is not None]))

    def draws_refused(self, cfg: ParallelConfig, balance: Sequence[int]) -> bool:
        """Whether training refuses ``cfg`` cut by ``balance``: dropout or stochastic depth on two stages or on
        replicas would not draw one process's masks (``pipeline/stage_draws.py``)."""
        layers = [p.layer for p in self.profiles if p.layer is not None]
        return len(layers) == len(self.profiles) and draws_refusal(layers, balance, cfg) is not None

    def memory(self, cfg: ParallelConfig) -> MemoryPlan:
        return estimate_memory(self.profiles, cfg, self.image_size, self.batch_size, precision=self.precision,
                               recompute=self.recompute, loss_fn=self.loss_fn, optimizer=self.optimizer,
                               optimizer_states=self.optimizer_states)


def _by_memory(step: _StepEstimate, candidates: Sequence[ParallelConfig], limit: float, headroom: float,
               zero_stages: Sequence[int] = (0,)) -> tuple[list[tuple[ParallelConfig, MemoryPlan]], list[Refusal]]:
    """The candidates whose every rank fits ``limit`` less ``headroom`` at the lowest of ``zero_stages`` that
    fits (with their plans), and the refused ones (at the highest tried); a candidate the memory model cannot
    lay out, or that training refuses for its random draws, is left out."""
    fitting: list[tuple[ParallelConfig, MemoryPlan]] = []
    refused: dict[ParallelConfig, Refusal] = {}
    for base in candidates:
        tried: set[ParallelConfig] = set()
        for zero in sorted(set(zero_stages)):
            try:
                cfg = canonical(base.with_(zero_stage=zero))
                if cfg in tried:            # no stage shared: every ZeRO stage is the same run
                    continue
                tried.add(cfg)
                plan = step.memory(cfg)
            except (ConfigError, ValueError):
                continue
            if step.draws_refused(cfg, plan.balance):    # train would refuse it (pipeline/stage_draws.py)
                break
            if plan.peak <= limit * (1 - headroom):
                fitting.append((cfg, plan))
                refused.pop(base, None)
                break
            refused[base] = Refusal(cfg, plan, limit, headroom)
    return fitting, list(refused.values())


@dataclass(frozen=True)
class _Timing:
    """Where the candidates' steps are timed: the network between ranks, the node, the measuring device."""

    network: Network | None
    node: Node
    bench: MeasuringDevice
    timer: LayerTimer | None


def _ranked(step: _StepEstimate, where: _Timing, serial_cfg: ParallelConfig,
            fitting: Sequence[tuple[ParallelConfig, MemoryPlan]], threads: int | None
            ) -> tuple[list[Suggestion], TimePlan]:
    """The fitting configurations timed (their layers with the one-process reference's, ranked alike), fastest
    first (ties: fewer ranks, lower peak), and the one-process reference's time."""
    def timed(cfg: ParallelConfig, rank_threads: int | None) -> StepModel:
        return step_model(step.profiles, cfg, step.image_size, step.batch_size, network=where.network,
                          node=where.node, device=where.bench, timer=where.timer, threads=rank_threads,
                          precision=step.precision, recompute=step.recompute, loss_fn=step.loss_fn)

    serial_model = timed(serial_cfg, None)
    models = [timed(cfg, threads) for cfg, _ in fitting]
    time_layers([serial_model, *models])     # every candidate's layers timed together: ranked alike
    serial_time = serial_model.predict()
    ranked = []
    for (cfg, plan), found in zip(fitting, models):
        time_plan = found.predict()
        ranked.append(Suggestion(cfg, cfg.world_size, plan.peak, time_plan.seconds,
                                 serial_time.seconds / time_plan.seconds if time_plan.seconds else float("inf"),
                                 plan, time_plan, step.exchanges(cfg)))
    ranked.sort(key=lambda s: (round(s.est_step_time, 9), s.world_size, s.peak_bytes))
    return ranked, serial_time
