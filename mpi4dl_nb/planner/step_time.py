"""Time model: a step's time from measured layer times, the network, the replayed schedule (docs/planner-models.md)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict, Unpack

import torch

from ..config import ParallelConfig
from ..layout import layout, stage_holders
from ..pipeline.actions import Action, ActionKind
from ..pipeline.bn_replay import running_stat_norms
from ..pipeline.schedules import build_schedule, stage_ranks
from ..pipeline.split_backward import splits_backward
from .attention import exposed_ring_seconds
from .crowding import Crowding, crowds
from .device import LayerTime, MeasuringDevice, TimingRequest
from .fake_world import Traffic
from .footprint import LayerFootprint
from .layer_timer import LayerTimer, measuring_device
from .memory import (
    DEFAULT_CACHE,
    LossFn,
    Precision,
    Recompute,
    StageModel,
    _profiles,
    balance_of,
    default_loss,
    settings_of,
)
from .profile import LayerProfile, Layers, batched
from .simulate import Cost, RankTimeline, group_key, simulate
from .tile_footprints import FootprintCache
from .timing import Network, Node
from .token_tiles import attention_widths

HEADER_BYTES = 162 * 8
# Share of a layer-with-parameters' backward that is its weight gradient: a conv's or linear's
# backward is two products of the forward's size (input gradient, weight gradient), so half each.
# BatchNorm/ReLU/pooling without parameters: all input gradient. A documented split, not measured.
WEIGHT_GRADIENT_SHARE = 0.5
DEFAULT_TIMERS: dict[tuple[MeasuringDevice, int, int], LayerTimer] = {}


def default_timer(device: MeasuringDevice | torch.device | str, repeats: int = 5, threads: int = 1) -> LayerTimer:
    """A LayerTimer shared by every prediction on ``device`` with ``threads`` torch threads
    (layer times measured once)."""
    key = (measuring_device(device), repeats, threads)
    if key not in DEFAULT_TIMERS:
        DEFAULT_TIMERS[key] = LayerTimer(key[0], repeats, threads)
    return DEFAULT_TIMERS[key]


def rank_threads(node: Node, world_size: int) -> int:
    """Torch threads each of ``world_size`` ranks on ``node`` uses by default (``dl.init``:
    the cores split among the ranks, at least one; a GPU rank: one)."""
    return max(1, node.cores // world_size) if node.cores else 1


@dataclass
class TimePlan:
    """Predicted step of one configuration: seconds, and where each rank's time goes."""

    cfg: ParallelConfig
    batch_size: int
    seconds: float
    ranks: list[RankTimeline]
    halo_seconds: float = 0.0          # wire time of halo messages on the slowest tile, per step
    handoff_bytes: int = 0             # activation + gradient bytes between stages, per step
    allreduce_seconds: float = 0.0
    stage_seconds: dict[int, float] = field(default_factory=dict)   # forward + backward per chunk

    @property
    def images_per_second(self) -> float:
        return self.batch_size / self.seconds if self.seconds else float("inf")

    @property
    def idle_fraction(self) -> float:
        """Share of rank-time spent waiting (pipeline bubbles, waits for messages/tiles)."""
        total = self.seconds * len(self.ranks)
        return sum(r.waiting for r in self.ranks) / total if total else 0.0

    @property
    def oversubscription(self) -> float:
        """Wall time of compute beyond the work itself (ranks sharing cores), as a share."""
        return 0.0

    def binding(self) -> str:
        """One phrase: what limits the step."""
        if not self.ranks:
            return ""
        busiest = max(self.ranks, key=lambda r: r.compute)
        wire = sum(r.wire for r in self.ranks) / len(self.ranks)
        if self.idle_fraction > 0.35:
            return f"pipeline bubble / waits ({self.idle_fraction:.0%} of rank-time idle)"
        if wire > 0.25 * self.seconds:
            return f"communication ({wire / self.seconds:.0%} of the step on the wire)"
        return f"compute of rank {busiest.rank} ({busiest.compute / self.seconds:.0%} of the step)"


def tile_cost(network: Network, group: Hashable, members: int, work: float, wire: float, meetings: int,
              cores: int | None, world: int, crowding: Crowding | None) -> Cost:
    """One tile's cost of a spatial op of ``members`` tiles (``group``): ``work``, then ``wire``
    seconds and ``meetings`` meetings of the group (``Network.meeting``; with ``crowding``, while
    the ``world`` ranks outnumber the ``cores``: more tiles than cores crowd their own meetings,
    ``Crowding.meeting_extra``, fewer are crowded by other ranks computing, ``Cost.crowded``),
    in lockstep, exposed to waiting ranks' wake-ups in the share of its time it computes."""
    delay, crowded = wire, 0.0
    if meetings:
        delay += meetings * network.meeting
        if crowding is not None and cores is not None:
            delay += meetings * crowding.meeting_extra(members, work / meetings, cores, world)
            if members <= cores:
                crowded = meetings * crowding.crowded_meeting(work / meetings)
    return Cost(work, delay, group, members, crowded, lockstep=True,
                exposed=work / (work + delay) if work > 0 else 1.0)


@dataclass
class _Costs:
    """Per-action costs of one configuration (see the module docstring)."""

    model: StageModel
    timer: LayerTimer
    network: Network
    node: Node
    recompute: Recompute
    holders: dict[tuple[int, int, int], tuple[int, ...]]
    held: dict[int, list[int]]            # rank -> stages it holds (a GEMS copy twice)
    crowding: Crowding | None = None      # the crowded-core terms, when the ranks outnumber the cores
    _stage: dict[tuple[int, int | None], tuple[float, float, float, float]] = field(default_factory=dict)

    def request(self, stage: int, index: int) -> TimingRequest:
        """Layer ``index`` as ``stage`` runs it: on one chunk, in the stage's role."""
        model = self.model
        profile = model.profiles[index]
        assert profile.layer is not None
        last = index == len(model.profiles) - 1
        return TimingRequest(profile.layer, tuple(batched(s, model.chunk) for s in profile.in_shapes),
                             model.precision.activations, model.role(stage), model._loss if last else None,
                             model.loss_fn, images=index == 0)

    def requests(self) -> list[TimingRequest]:
        """Every layer of every stage this configuration times."""
        bounds = self.model.bounds
        return [self.request(stage, index) for stage in range(self.model.cfg.split_size)
                for index in range(bounds[stage], bounds[stage + 1])]

    def layer_time(self, stage: int, index: int, tile: int | None) -> tuple[LayerTime, LayerFootprint]:
        r = self.request(stage, index)
        footprints = self.model.cache.layer(r.layer, r.shapes, r.dtype, r.role, loss=r.loss, loss_key=r.loss_key,
                                            elementwise=self.model.elementwise)
        timed = self.timer.layer(r.layer, r.shapes, r.dtype, r.role, loss=r.loss, loss_key=r.loss_key, images=r.images)
        return timed, footprints[tile or 0]

    def stage(self, stage: int, tile: int | None) -> tuple[float, float, float, float]:
        """(forward work, forward wire, backward work, backward wire) of one chunk."""
        key = (stage, tile)
        if key not in self._stage:
            fw = fd = bw = bd = 0.0
            spatial = stage < self.model.cfg.spatial_size
            for index in range(self.model.bounds[stage], self.model.bounds[stage + 1]):
                timed, fp = self.layer_time(stage, index, tile)
                fw += timed.forward
                bw += timed.backward
                if spatial:
                    fd += self._layer_wire(stage, index, timed, fp.forward_traffic, backward=False)
                    bd += self._layer_wire(stage, index, timed, fp.backward_traffic, backward=True)
            if self.recompute is not Recompute.NONE:   # every layer's forward again; halo strips kept: no wire
                bw += fw
            self._stage[key] = (fw, fd, bw, bd)
        return self._stage[key]

    def weight_gradient(self, stage: int, tile: int | None) -> float:
        """Seconds of one chunk's weight-gradient part of the backward (``W``; module docstring); none where
        the engine does not split the stage's backward (``split_backward.splits_backward``)."""
        if not splits_backward(self.model.cfg, stage):
            return 0.0
        start, stop = self.model.bounds[stage], self.model.bounds[stage + 1]
        return WEIGHT_GRADIENT_SHARE * sum(self.layer_time(stage, index, tile)[0].backward
                                           for index in range(start, stop) if self.model.profiles[index].param_count)

    def meetings(self, stage: int, tile: int | None) -> tuple[int, int]:
        """Halo exchanges and collectives of one chunk's forward and backward on a spatial stage
        (each a meeting of the tile group, ``Network.meeting``, and ``Crowding.crowded_meeting`` when
        the ranks computing outnumber the cores); 0 otherwise."""
        if stage >= self.model.cfg.spatial_size:
            return 0, 0
        forward = backward = 0
        for index in range(self.model.bounds[stage], self.model.bounds[stage + 1]):
            fp = self.layer_time(stage, index, tile)[1]
            forward += fp.forward_traffic.meetings
            backward += fp.backward_traffic.meetings
        return forward, backward

    def _stage_times(self, stage: int) -> list[LayerTime]:
        tile = 0 if stage < self.model.cfg.spatial_size else None
        return [self.layer_time(stage, index, tile)[0]
                for index in range(self.model.bounds[stage], self.model.bounds[stage + 1])]

    def optimizer(self, stage: int) -> float:
        """Seconds of the optimizer update of one copy of ``stage``."""
        return sum(t.optimizer for t in self._stage_times(stage))

    def reduction(self, stage: int, holders: int) -> float:
        """Local seconds of one copy's gradient/statistics action: gradients flattened and copied
        back, BatchNorm statistics of every chunk of the global batch (exchanged between the
        ``holders`` of the stage, replayed)."""
        return sum(t.reduction(self.model.cfg.batch_divisor, holders) for t in self._stage_times(stage))

    def holder_meetings(self, stage: int) -> int:
        """Collectives of the holders' gradient/statistics action (``pipeline.dataparallel``):
        the gradient sum, and with BatchNorm the term counts gathered and the terms summed."""
        layers = [self.model.profiles[i].layer for i in range(self.model.bounds[stage], self.model.bounds[stage + 1])]
        norms = any(running_stat_norms(layer) for layer in layers if layer is not None)
        return int(self.model.param_count(stage) > 0) + (2 if norms else 0)

    def setup(self, rank: int) -> float:
        """Seconds a rank spends starting a step: train mode, gradients dropped, BatchNorm
        statistics remembered, for every stage copy it holds."""
        return sum(t.setup for stage in self.held[rank] for t in self._stage_times(stage))

    def _layer_wire(self, stage: int, index: int, timed: LayerTime, traffic: Traffic, backward: bool) -> float:
        """Wire seconds of layer ``index`` of spatial ``stage`` in one chunk's forward or ``backward``: a halo
        layer's messages (``_wire``), or a ViT layer's rings: each step's message travels while the step's block
        attention runs (``attention.exposed_ring_seconds``; in backward a key/value block and a gradient
        accumulator per step, and the accumulator's last hop after the last block)."""
        members = self.model.cfg.num_spatial_parts
        layer = self.model.profiles[index].layer
        rings = len(attention_widths(layer)) if layer is not None and self.model.role(stage).tokens else 0
        if not rings or not traffic.messages:
            return self._wire(traffic, members)
        message = traffic.message_bytes / traffic.messages
        steps, block = rings * (members - 1), timed.ring_block[int(backward)]
        if not backward:
            return exposed_ring_seconds(steps, self.network.message(message), block)
        return exposed_ring_seconds(steps, self.network.message(2 * message), block,
                                    rings * self.network.message(message))

    def _wire(self, traffic: Traffic, members: int) -> float:
        per_message = traffic.message_bytes / traffic.messages if traffic.messages else 0.0
        halo = traffic.messages * self.network.message(per_message) / 2   # sends overlap receives
        sums = traffic.collectives * self.network.reduction_bytes(    # each a meeting: its latency counted there
            traffic.collective_bytes / max(1, traffic.collectives), members)
        return halo + sums

    @property
    def cores(self) -> int | None:
        """The cores the ranks share when they outnumber them (``crowding``); None otherwise: a
        core or device each, no crowded-core term."""
        return self.node.cores if self.crowding is not None else None

    def copy_seconds(self, nbytes: float) -> float:
        return nbytes / self.node.copy_bandwidth

    def __call__(self, action: Action) -> Cost:
        kind = action.kind
        cfg = self.model.cfg
        if kind is ActionKind.BACKWARD_WEIGHT:   # no halo, no meeting: the rank's own work
            return Cost(self.weight_gradient(action.stage, action.tile))
        if kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            tile = action.tile
            fw, fd, bw, bd = self.stage(action.stage, tile)
            fp = self.model.footprint(action.stage, tile)
            spatial = action.stage < cfg.spatial_size
            if kind is ActionKind.FORWARD:
                work, delay = fw, fd
                if action.stage == 0 and spatial:
                    work += self.copy_seconds(fp.input_bytes)           # cutting the tile
                if action.stage > 0 and action.stage - 1 < cfg.spatial_size <= action.stage:
                    work += self.copy_seconds(fp.input_bytes)           # joining the tiles
            else:
                work, delay = bw, bd
                if kind is ActionKind.BACKWARD_INPUT:
                    work -= self.weight_gradient(action.stage, tile)
            if spatial:
                ranks = self.holders[(action.dp, action.replica, action.stage)]
                meetings = self.meetings(action.stage, tile)[0 if kind is ActionKind.FORWARD else 1]
                return tile_cost(self.network, group_key(action, ranks, "tiles"), len(ranks), work, delay,
                                 meetings, self.cores, cfg.world_size, self.crowding)
            return Cost(work, delay)
        if kind is ActionKind.ALLREDUCE:   # every copy of the stage this rank holds, then the holders' sum
            ranks = tuple(stage_holders(cfg, action.stage))
            grad = self.model.param_count(action.stage) * _size(self.model.precision.weight_dtype)
            work = self.held[action.rank].count(action.stage) * self.reduction(action.stage, len(ranks))
            meetings = self.holder_meetings(action.stage) if len(ranks) > 1 else 0
            delay = self.network.all_reduce(grad, len(ranks)) + meetings * self.network.meeting
            crowded = meetings * self.crowding.crowded_meeting(work / meetings) if meetings and self.crowding else 0.0
            return Cost(work, delay, ("allreduce", action.stage, ranks), len(ranks), crowded)   # every holder, one sum
        if kind is ActionKind.OPTIM:       # the optimizer update of every stage copy held
            return Cost(sum(self.optimizer(s) for s in self.held[action.rank]))
        if kind.is_p2p:                    # a hand-off's own work on each side (the wire: ``message``)
            return Cost(self.network.handoff)
        return Cost()

    def payload_bytes(self, action: Action) -> int:
        """Bytes a send carries: the stage output (activations) or the input gradient piece."""
        if action.kind.carries_activation:
            tile = action.tile if action.stage < self.model.cfg.spatial_size else None
            return self.model.footprint(action.stage, tile).output_bytes
        return self._grad_piece(action)

    def message(self, action: Action) -> float:
        """Seconds from a send to its arrival: the header, then the tensor (none to itself: zbv's turn)."""
        if action.peer == action.rank:
            return 0.0
        return self.network.message(HEADER_BYTES) + self.network.message(self.payload_bytes(action))

    def _grad_piece(self, action: Action) -> int:
        cfg = self.model.cfg
        stage = action.stage
        if 0 < stage and stage - 1 < cfg.spatial_size <= stage:
            ranks = self.holders[(action.dp, action.replica, stage - 1)]
            return self.model.footprint(stage - 1, ranks.index(action.peer)).output_bytes
        tile = action.tile if stage < cfg.spatial_size else None
        return self.model.footprint(stage, tile).input_grad_bytes


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class StepModel:
    """A configuration's step-time model, built but not yet run: its per-action costs (their
    layers timed on first use, or all together by ``time_layers``) and schedule."""

    cfg: ParallelConfig
    batch_size: int
    costs: _Costs
    network: Network
    node: Node

    def requests(self) -> list[TimingRequest]:
        """The layers its prediction times."""
        return self.costs.requests()

    def predict(self) -> TimePlan:
        """The step replayed in simulated time (``predict_step_time``)."""
        cfg, costs, network = self.cfg, self.costs, self.network
        schedule = build_schedule(cfg)
        slowdown = costs.crowding.waiting_slowdown if costs.crowding is not None else 1.0
        timelines = simulate(schedule, costs, costs.message, costs.cores, costs.setup, slowdown)
        finish = network.all_reduce(8, cfg.world_size) + (network.meeting if cfg.world_size > 1 else 0.0)
        seconds = max(t.end for t in timelines) + finish      # the loss summed over every rank
        handoff = sum(costs.payload_bytes(a) for a in schedule.global_order() if a.kind.is_p2p and a.kind.is_send)
        halo = 0.0
        for stage in range(cfg.spatial_size):
            _, fd, _, bd = costs.stage(stage, 0)
            halo += (fd + bd) * cfg.parts * (2 * cfg.times if cfg.gems else 1) * cfg.local_dp
        stage_seconds = {}
        for stage in range(cfg.split_size):
            fw, fd, bw, bd = costs.stage(stage, 0 if stage < cfg.spatial_size else None)
            stage_seconds[stage] = fw + fd + bw + bd
        weight_bytes = _size(costs.model.precision.weight_dtype)
        allreduce = sum(network.all_reduce(costs.model.param_count(s) * weight_bytes, len(stage_holders(cfg, s)))
                        for s in range(cfg.split_size))
        return TimePlan(cfg, self.batch_size, seconds, timelines, halo, handoff, allreduce, stage_seconds)


def step_model(model: Layers | Sequence[LayerProfile], cfg: ParallelConfig,
               image_size: int | tuple[int, int], batch_size: int, *,
               network: Network | None = None, node: Node | None = None,
               device: MeasuringDevice | torch.device | str = "auto",
               timer: LayerTimer | None = None, threads: int | None = None, in_channels: int = 3,
               dtype: torch.dtype = torch.float32, precision: Precision | None = None,
               recompute: Recompute | str | None = None,
               loss_fn: LossFn = default_loss,
               cache: FootprintCache | None = None) -> StepModel:
    """``cfg``'s StepModel, nothing timed yet (``predict_step_time`` times and runs it).

    ``network``: from ``calibrate_network`` on the cluster (default: a shared-memory guess);
    ``device``: the job's device, where layer times and copy speed are measured (a
    ``MeasuringDevice`` or a torch device; ``"auto"``: the one ``dl.init()`` would give this
    process, CUDA when visible); ``node``: the cores the ranks share and the copy speed
    (default: measured on ``timer``'s device, else ``device``: a CPU's cores, a GPU per rank);
    ``timer``: where layer times are measured and cached (default: this process, on ``device``,
    with the threads each rank of ``cfg`` gets from ``dl.init`` on ``node``, ``rank_threads``;
    ``threads``: the ranks' torch threads when they differ, e.g. cluster engines started with
    OMP_NUM_THREADS=1). The crowded-core terms of ``network`` apply only when ``cfg``'s ranks
    outnumber ``node``'s cores (``crowding.crowds``).
    ``precision``/``recompute`` None: from ``cfg``'s memory knobs (``memory.settings_of``).
    """
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    precision, recompute = settings_of(cfg, dtype, precision, recompute)
    profiles = _profiles(model, (height, width), in_channels, precision.activations)
    cfg.validate(batch_size=batch_size, num_layers=len(profiles))
    balance = balance_of(profiles, cfg, (height, width), in_channels)
    stage_model = StageModel(cfg, profiles, balance, batch_size // cfg.batch_divisor, precision,
                             cache or DEFAULT_CACHE, loss_fn)
    node = node or Node.measured(timer.bench if timer else device)
    timer = timer or default_timer(device, threads=threads or rank_threads(node, cfg.world_size))
    network = network or Network()
    crowding = network.crowding if crowds(node.cores, cfg.world_size) else None
    roles = layout(cfg)
    held = {role.rank: [slot.stage for _, slot in role.slots()] for role in roles}   # a copy per slot
    costs = _Costs(stage_model, timer, network, node, recompute, stage_ranks(cfg, roles), held, crowding)
    return StepModel(cfg, batch_size, costs, network, node)



class StepOptions(TypedDict, total=False):
    """``step_model``'s keyword options, as ``predict_step_time`` passes them on."""

    network: Network | None
    node: Node | None
    device: MeasuringDevice | torch.device | str
    timer: LayerTimer | None
    threads: int | None
    in_channels: int
    dtype: torch.dtype
    precision: Precision | None
    recompute: Recompute | str | None
    loss_fn: LossFn
    cache: FootprintCache | None


def time_layers(models: Iterable[StepModel]) -> None:
    """Time the layers of all ``models`` together, each timer's in one interleaved measurement
    (``LayerTimer.measure``): a slow spell of the machine then falls on every configuration alike,
    not on the one whose layers were being timed."""
    by_timer: dict[int, tuple[LayerTimer, list[TimingRequest]]] = {}
    for model in models:
        timer = model.costs.timer
        by_timer.setdefault(id(timer), (timer, []))[1].extend(model.requests())
    for timer, requests in by_timer.values():
        timer.measure(requests)


def predict_step_time(model: Layers | Sequence[LayerProfile], cfg: ParallelConfig,
                      image_size: int | tuple[int, int], batch_size: int, **options: Unpack[StepOptions]) -> TimePlan:
    """Predicted seconds of one ``train_step`` of ``cfg`` on ``batch_size`` images (``options``:
    those of ``step_model``). Several configurations: ``step_model`` each, ``time_layers`` them
    together, then ``predict`` each."""
    found = step_model(model, cfg, image_size, batch_size, **options)
    time_layers([found])
    return found.predict()
