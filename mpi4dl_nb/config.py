"""ParallelConfig: the MPI4DL knobs of one run, with validation that names the fix."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from .errors import ConfigError
from .layout import RankRole, layout
from .schema import FLAG_KEY, Bounds, Flag, FlagSettings, flag, option, whole_number

if TYPE_CHECKING:
    from typing import Unpack


class Choice(str, Enum):
    """A string-valued Enum: each member equals, hashes, prints and formats as its value,
    so ``"square"`` and ``SliceMethod.SQUARE`` are interchangeable (JSON, CLI, widgets)."""

    __hash__ = str.__hash__   # Python 3.10's Enum hashes the member name

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:   # 3.11 formats str mixins as "Class.NAME"
        return format(str(self.value), spec)

    def __repr__(self) -> str:   # reprs of configs and actions stay valid constructor calls
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's value, in definition order."""
        return tuple(str(member.value) for member in cls)


class SliceMethod(Choice):
    """How ``num_spatial_parts`` tiles are laid out (MPI4DL's ``--slice-method``)."""

    SQUARE = "square"           # sqrt(P) x sqrt(P), P a perfect square
    VERTICAL = "vertical"       # 1 row x P columns (vertical cuts)
    HORIZONTAL = "horizontal"   # P rows x 1 column (horizontal cuts)

    def grid_shape(self, num_parts: int) -> tuple[int, int]:
        """(rows, cols) of ``num_parts`` tiles (square: rows = cols = isqrt(num_parts))."""
        if self is SliceMethod.SQUARE:
            root = math.isqrt(num_parts)
            return (root, root)
        if self is SliceMethod.VERTICAL:
            return (1, num_parts)
        return (num_parts, 1)


class ScheduleKind(Choice):
    """Order of the micro-batches' forwards and backwards on each pipeline stage."""

    GPIPE = "gpipe"         # all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"    # warm-up forwards, then one forward one backward, then drain
    INTERLEAVED = "interleaved"   # 1F1B over virtual_stages chunks per rank (Megatron's interleaving)
    ZB1 = "zb1"             # zero bubble ZB-H1: backward split into I (input grad) and W (weight grad)
    ZBV = "zbv"             # V-shaped zero bubble: 2 chunks per rank, down then back up, split backward

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as I (input gradient) and W (weight gradient) actions."""
        return self in (ScheduleKind.ZB1, ScheduleKind.ZBV)

    @property
    def places_chunks(self) -> bool:
        """Whether the schedule lays several stages (chunks) on each pipeline position (virtual_stages)."""
        return self in (ScheduleKind.INTERLEAVED, ScheduleKind.ZBV)


C = TypeVar("C", bound=Choice)


def parse_choice(kind: type[C], value: object, knob: str, expected: str) -> C:
    """``value`` as a member of ``kind``; ConfigError ``<value> is not <expected>`` otherwise."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        raise ConfigError(knob, f"{value!r} is not {expected}") from None


class PrecisionMode(Choice):
    """Compute dtype of forward and backward (autocast); master weights stay float32."""

    FP32 = "fp32"   # the parameters' own dtype (float32 or float64): no autocast
    BF16 = "bf16"   # autocast to bfloat16 (CPU and GPU)
    FP16 = "fp16"   # autocast to float16 with a gradient scaler (GPU only)


class CheckpointGranularity(Choice):
    """How ``checkpoint_activations`` cuts a stage into segments, when not given a layer count."""

    EVERY = "every"     # each layer a segment
    BLOCKS = "blocks"   # segments of ceil(sqrt(layers)) layers (the memory-optimal cut for equal layers)


CheckpointSetting = CheckpointGranularity | int   # a granularity, or N >= 1 layers per segment
Knob = int | float | str | list[int] | None             # a knob's JSON-friendly value (``as_dict``)

# layer counts separated by commas or blanks, a trailing comma allowed (``[3, 4,]``, as Python reads it)
BALANCE_SYNTAX = re.compile(r"\s*[+-]?\d+(\s*[,\s]\s*[+-]?\d+)*\s*,?\s*")
SLICE_METHODS = SliceMethod.values()
SCHEDULES = ScheduleKind.values()
PRECISIONS = PrecisionMode.values()
CHECKPOINT_GRANULARITIES = CheckpointGranularity.values()


def as_checkpoint_setting(value: object) -> CheckpointSetting | None:
    """``checkpoint_activations`` normalised: None/"none"/0/False -> None, True -> EVERY,
    "every"/"blocks" -> their CheckpointGranularity, N or "N" (N >= 1) -> N."""
    if value is None or value is False or value == "none" or value == 0:
        return None
    if value is True:
        return CheckpointGranularity.EVERY
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and value >= 1:
        return value
    if value in CHECKPOINT_GRANULARITIES:
        return CheckpointGranularity(value)
    raise ConfigError("checkpoint_activations", f"{value!r} is not 'every' (each layer), 'blocks' "
                      f"(segments of about sqrt(layers) layers), a number N >= 1 of layers per "
                      f"segment, or None")


def parse_balance(text: str | None, knob: str = "balance") -> tuple[int, ...] | None:
    """``balance`` (``--balance``, the widget's field) as layer counts per stage: ``3,4,5``, ``3 4 5``,
    ``[3, 4, 5]``, ``(3,4,5)`` or one count ``3``; empty or ``none``: None (the default cut). ConfigError naming
    ``knob`` for anything else (the counts are checked against the stages by ParallelConfig)."""
    if text is None or str(text).strip().lower() in ("", "none"):
        return None
    raw = str(text).strip()
    if raw[0] + raw[-1] in ("[]", "()"):
        raw = raw[1:-1]
    if not BALANCE_SYNTAX.fullmatch(raw):
        raise ConfigError(knob, f"{text!r} is not a list of layer counts per stage, e.g. 3,4,5 or [3,4,5] (empty "
                                f"or none: the default cut, by memory when there are spatial stages)")
    return tuple(int(count) for count in re.findall(r"[+-]?\d+", raw))


def as_slice_method(value: object) -> SliceMethod:
    """``value`` (``"square"`` or a member) as a SliceMethod; ConfigError naming the choices."""
    return parse_choice(SliceMethod, value, "slice_method", f"one of {', '.join(SLICE_METHODS)} or DxRxC "
                        f"(a volume's depth x rows x cols tiles, e.g. 2x2x2)")


def volume_slices(value: object) -> tuple[int, int, int] | None:
    """``"DxRxC"`` (``--slice-method 2x2x2``: a volume's depth x rows x cols tiles) as ``(D, R, C)``; None
    for anything else (the image slice methods); ConfigError for a DxRxC with a count below 1."""
    parts = str(value).strip().lower().split("x") if isinstance(value, str) else []
    if len(parts) != 3 or not all(part.strip().isdigit() for part in parts):
        return None
    depth, rows, cols = (int(part) for part in parts)
    if min(depth, rows, cols) < 1:
        raise ConfigError("slice_method", f"{value!r}: a volume's grid needs at least one tile along depth, "
                          f"rows and cols, e.g. 2x2x2")
    return (depth, rows, cols)


def parse_slice_method(text: str) -> str:
    """``--slice-method``: an image's tile layout (square, vertical, horizontal) or a volume's ``DxRxC`` (depth x
    rows x cols tiles, e.g. ``2x2x2``), normalised; ConfigError naming the choices."""
    key = str(text).strip().strip('"').strip("'").lower()
    volume = volume_slices(key)
    if key not in SLICE_METHODS and volume is None:
        raise ConfigError("--slice-method", f"{text!r}: choose one of {', '.join(SLICE_METHODS)}, or DxRxC for a "
                                            f"volume's depth x rows x cols tiles (e.g. 2x2x2)")
    return key if volume is None else "x".join(map(str, volume))


def as_schedule_kind(value: object) -> ScheduleKind:
    """``value`` (``"1f1b"`` or a member) as a ScheduleKind; ConfigError naming the choices."""
    return parse_choice(ScheduleKind, value, "schedule", " or ".join(f"'{v}'" for v in SCHEDULES))


def parse_bucket_mb(text: str) -> float | None:
    """``--grad-bucket-mb``: a size in MB, or ``none`` (one all-reduce per stage after all backwards)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError("not a size in MB (e.g. 25) or 'none'") from None


PARALLEL_GROUP = "parallelism (MPI4DL flags)"
K = TypeVar("K")

# ----------------------------------------------------------------- options several commands take, declared once
DTYPES = ("float32", "float64")     # the parameter and activation dtypes of a run (train, evaluate, infer, tune)
DTYPE = option("--dtype", "parameter and activation dtype", choices=DTYPES, group="run")
PROGRESS = option("--no-progress", "no progress bar (on rank 0)", switch=True, group="run")
NUM_SPATIAL_PARTS = option("--num-spatial-parts", "ranks that share each image, one tile each (train: per spatial "
                                                  "stage; infer: each window; = the ranks to launch)",
                           parse=whole_number, bounds=Bounds(1), group=PARALLEL_GROUP)
SLICE_METHOD = option(
    "--slice-method", f"how an image (infer: a window) is cut into tiles: {', '.join(SLICE_METHODS)}, or DxRxC for a "
                      f"volume's depth x rows x cols tiles (e.g. 2x2x2, with --num-spatial-parts D*R*C; infer's "
                      f"default for a volume: 1x1x1)", parse=parse_slice_method, metavar="SLICE_METHOD",
    group=PARALLEL_GROUP)


def _knob(option: str, help: str, default: K, **how: Unpack[FlagSettings]) -> K:
    """A ParallelConfig field given by an MPI4DL flag (``option``), in the parallelism group."""
    how["group"] = PARALLEL_GROUP
    return flag(option, help, default, **how)


def _nearest_square(n: int) -> int:
    root = max(1, round(math.sqrt(n)))
    return root * root


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelConfig:
    """How one model is laid on the ranks: spatial, layer, pipeline, GEMS and data parallelism.

    Knob names follow MPI4DL (``--split-size`` is ``split_size`` ...). ``spatial_size=0``
    means no spatial stage; ``times=0`` means no GEMS, ``times=k`` means GEMS with ``k``
    replica pairs; ``data_parallel`` is the number of full replicas of the whole layout.
    ``sync_batchnorm``: the data-parallel copies of a micro-batch (full replicas and local-DP
    copies) normalise BatchNorm over their combined samples; with ``parts=1`` and no GEMS that
    is one full-batch serial run. GEMS directions keep separate statistics (the mirror's
    chunks run at other times). docs/exactness.md: "BatchNorm semantics".
    ``check_ops``: the spatial op guard checks every torch op custom forwards apply to tiles
    (False skips the checks once a model has passed).
    ``checkpoint_activations``: activation recomputation on every stage (None: off; 'every':
    each layer a segment; 'blocks': segments of ceil(sqrt(layers)) layers; N: N layers per
    segment): a stage keeps only its segments' inputs and recomputes inside on backward.
    ``precision``: 'fp32' (the parameters' dtype), 'bf16' or 'fp16' (GPU, gradient scaler):
    forward under autocast, master weights and BatchNorm statistics in float32.
    ``virtual_stages``: with ``schedule='interleaved'``, the chunks each rank holds: the
    ``split_size`` stages lie on ``split_size / virtual_stages`` ranks, stage s on s mod that.
    ``schedule='zbv'`` always holds 2 (set for it): position r of P holds stages r and 2P-1-r.
    ``grad_bucket_mb``: the size cap of the gradient buckets whose all-reduce over a stage's holders
    starts during backward, as soon as the bucket's gradients of the step are complete (default 25,
    DDP's; None: one all-reduce per stage after all backwards, no overlap).
    """

    split_size: int = _knob("--split-size", "number of model partitions (stages) for layer/pipeline parallelism", 2,
                            parse=whole_number, bounds=Bounds(1))
    spatial_size: int = _knob("--spatial-size", "how many of the first stages use spatial parallelism (0: none)", 1,
                              parse=whole_number, bounds=Bounds(0))
    num_spatial_parts: int = NUM_SPATIAL_PARTS.field(4)
    slice_method: SliceMethod = SLICE_METHOD.field(SliceMethod.SQUARE)
    parts: int = _knob("--parts", "number of micro-batches for pipeline parallelism", 1, parse=whole_number,
                       bounds=Bounds(1))
    times: int = _knob("--times", "GEMS replica pairs (0: no GEMS; 1 behaves like MPI4DL's GEMS scripts)", 0,
                       parse=whole_number, bounds=Bounds(0))
    local_dp: int = _knob("--local-DP", "data-parallel copies of each non-spatial stage", 1, parse=whole_number,
                          bounds=Bounds(1))
    halo_d2: bool = _knob("--halo-D2", "fused halo exchange (design 2): fewer, wider halo exchanges", False,
                          switch=True)
    fused_layers: int = _knob("--fused-layers", "with --halo-D2, number of blocks sharing one halo exchange", 1,
                              parse=whole_number, bounds=Bounds(1))
    balance: tuple[int, ...] | None = _knob("--balance", "layers per stage, e.g. 3,4,5 (sum = number of layers); "
                                                         "default automatic", None,
                                            parse=partial(parse_balance, knob="--balance"))
    data_parallel: int = _knob("--data-parallel", "number of full model replicas trained data-parallel", 1,
                               parse=whole_number, bounds=Bounds(1))
    schedule: ScheduleKind = _knob(
        "--schedule", "pipeline schedule of the micro-batches (extension; MPI4DL uses gpipe; interleaved: with "
                      "--virtual-stages; zb1: zero bubble, each backward split into input- and weight-gradient "
                      "halves, --parts >= --split-size; zbv: zero bubble V, 2 chunks per rank, rank r holding stages "
                      "r and split-size-1-r, --parts >= split-size / 2)", ScheduleKind.GPIPE, choices=SCHEDULES)
    grid: tuple[int, int] | None = field(default=None)
    # a volume's depth x rows x cols tiles (``slice_method="DxRxC"`` sets it; issue 45)
    volume_grid: tuple[int, int, int] | None = field(default=None)
    sync_batchnorm: bool = _knob(
        "--sync-batchnorm", "BatchNorm over the combined samples of the data-parallel copies of a micro-batch (with "
                            "--parts 1 and no GEMS: one full-batch serial run; GEMS directions keep separate "
                            "statistics)", False, switch=True)
    check_ops: bool = _knob("--no-check-ops", "skip the spatial op guard's per-op checks (once a model has passed "
                                              "them)", True, switch=True)
    # memory knobs (issue 14): activation recomputation per stage (None: off; 'every', 'blocks' or N
    # layers per segment) and the compute precision; the planner's models read them too
    checkpoint_activations: CheckpointSetting | None = _knob(   # 'every', 'blocks' or N accepted
        "--checkpoint-activations", "activation recomputation: keep only segment inputs, recompute on backward "
                                    "(every: each layer; blocks: ~sqrt(layers) per segment; N layers per segment)",
        None, parse=as_checkpoint_setting, const="every", metavar="every|blocks|N")
    precision: PrecisionMode = _knob(
        "--precision", "compute precision: autocast to bf16 (CPU/GPU) or fp16 (GPU, gradient scaler); master weights "
                       "and normalisation statistics stay float32", PrecisionMode.FP32, choices=PRECISIONS)
    # interleaved schedule (issue 44): the split_size stages lie on split_size / virtual_stages
    # pipeline positions, stage s on position s mod positions (each rank holds virtual_stages chunks)
    virtual_stages: int = _knob(
        "--virtual-stages", "with --schedule interleaved: chunks per rank; the --split-size stages lie on split-size "
                            "/ virtual-stages ranks, stage s on rank s mod that (Megatron); --schedule zbv sets 2",
        1, parse=whole_number, bounds=Bounds(1))
    # gradient all-reduce overlapped with backward (issue 44): a stage's gradients are summed over its
    # holders in buckets of about this many MB, each posted as soon as its last gradient of the step
    # arrived (None: one all-reduce per stage after every backward)
    grad_bucket_mb: float | None = _knob(
        "--grad-bucket-mb", "gradient all-reduce overlapped with backward: buckets of about MB megabytes, each summed "
                            "over the stage's holders as soon as its gradients are complete (25 is DDP's; none: one "
                            "all-reduce per stage after all backwards)", 25.0, parse=parse_bucket_mb,
        metavar="MB|none")
    # training state sharded over each group of ranks holding the same weights (issue 80): ZeRO's stages
    zero_stage: int = _knob(
        "--zero-stage", "shard training state over the ranks that hold the same weights (a spatial stage's tiles, "
                        "data-parallel replicas): 1 the optimizer state, 2 also the gradients (reduce-scatter), 3 "
                        "also the weights (gathered before use); 0: every holder keeps all of it", 0,
        parse=whole_number, bounds=Bounds(0, 3))

    def __post_init__(self) -> None:
        if self.balance is not None and not isinstance(self.balance, tuple):
            object.__setattr__(self, "balance", tuple(int(b) for b in self.balance))
        if self.grid is not None and not isinstance(self.grid, tuple):
            object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))
        volume = volume_slices(self.slice_method)
        if volume is not None:   # slice_method="2x2x2": a volume's grid; the image slice method stays default
            object.__setattr__(self, "volume_grid", volume)
            object.__setattr__(self, "slice_method", SliceMethod.SQUARE)
        elif self.volume_grid is not None and not isinstance(self.volume_grid, tuple):
            object.__setattr__(self, "volume_grid", tuple(int(g) for g in self.volume_grid))
        self._check_own_knobs()

    # ----------------------------------------------------------------- derived sizes
    @property
    def spatial_parts(self) -> int:
        """Ranks per spatial stage (1 when there is no spatial stage)."""
        return self.num_spatial_parts if self.spatial_size > 0 else 1

    @property
    def pipeline_positions(self) -> int:
        """Ranks (or tile / copy groups) along the pipeline: split_size / virtual_stages."""
        return self.split_size // self.virtual_stages

    def chunk_stages(self, position: int) -> tuple[int, ...]:
        """The stages pipeline position ``position`` holds, chunk by chunk: interleaved ``position + c x P``
        (P positions); zbv's V ``position`` then ``2P - 1 - position`` (down, then back up to position 0)."""
        positions = self.pipeline_positions
        if self.schedule is ScheduleKind.ZBV:
            return (position, 2 * positions - 1 - position)
        return tuple(position + c * positions for c in range(self.virtual_stages))

    @property
    def ranks_per_replica(self) -> int:
        """Ranks one model replica occupies (GEMS mirrors and later virtual stages share them)."""
        return (self.spatial_size * self.num_spatial_parts
                + (self.pipeline_positions - self.spatial_size) * self.local_dp)

    @property
    def world_size(self) -> int:
        """Ranks the whole configuration needs."""
        return self.ranks_per_replica * self.data_parallel

    @property
    def all_spatial(self) -> bool:
        """Every stage spatial (``spatial_size == split_size``): tiles from the input to the loss, nothing joined."""
        return self.spatial_size == self.split_size

    @property
    def gems(self) -> bool:
        """Whether the bidirectional GEMS mirror replica is used."""
        return self.times > 0

    @property
    def grid_shape(self) -> tuple[int, int]:
        """(rows, cols) of the tile grid of the spatial stages (an image's grid; see ``tile_grid_shape``)."""
        if self.volume_grid is not None:
            shown = "x".join(map(str, self.volume_grid))
            raise ConfigError("slice_method", f"{shown} tiles volumes (depth x rows x cols): the training engine, "
                              f"spatialize and TileGrid(depth=...) take it, this image path (rows x cols: the "
                              f"planner, image data, the viewer) does not; use square, vertical or horizontal "
                              f"for images")
        if self.grid is not None:
            return self.grid
        return self.slice_method.grid_shape(self.num_spatial_parts)

    @property
    def tile_grid_shape(self) -> tuple[int, ...]:
        """The tile grid's counts along every axis: ``(rows, cols)``, a volume's ``(depth, rows, cols)``."""
        return self.volume_grid if self.volume_grid is not None else self.grid_shape

    @property
    def batch_divisor(self) -> int:
        """The global batch must be a multiple of this for an even split."""
        gems_chunks = 2 * self.times if self.gems else 1
        return self.data_parallel * gems_chunks * self.local_dp * self.parts

    def layout(self) -> list[RankRole]:
        """The role of every rank (see ``mpi4dl_nb.layout.layout``)."""
        return layout(self)

    def with_(self, **changes: object) -> ParallelConfig:
        """A copy with some knobs changed, validated again (in the forms the constructor takes and
        normalises, e.g. ``slice_method="square"``; an unknown knob is a TypeError, as there)."""
        knobs = {f.name: getattr(self, f.name) for f in fields(self)}
        knobs.update(changes)
        return ParallelConfig(**knobs)

    def as_dict(self) -> dict[str, Knob]:
        """Knobs as a plain dict (JSON-friendly: tuples as lists, choices as their strings)."""
        def plain(value: object) -> Knob:
            if isinstance(value, Choice):
                return str(value)
            if isinstance(value, tuple):
                return list(value)
            assert value is None or isinstance(value, (int, float, str)), value
            return value

        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}

    # ------------------------------------------------------------------ validation
    def _check_own_knobs(self) -> None:
        """Every knob checked on its own and against the others (no model, world or batch needed), the choice
        knobs made their Enum members; the first problem raised as a ConfigError naming the way out."""
        self._check_counts()
        self._normalise_choices()
        self._check_recompute()
        self._check_stages()
        self._check_tile_grid()
        if self.fused_layers > 1 and not self.halo_d2:
            raise ConfigError("fused_layers", f"fused_layers={self.fused_layers} only applies with "
                              f"halo_d2=True; set halo_d2=True or fused_layers=1")
        if self.gems and self.split_size < 2:
            raise ConfigError("times", "GEMS (times >= 1) mirrors the stages and needs "
                              "split_size >= 2; use times=0 or split_size=2")
        if self.gems and self.zero_stage:
            raise ConfigError("--zero-stage", "shards a stage over the ranks holding it, and GEMS (--times) holds two "
                                              "copies of a stage on one rank: --zero-stage 0 with --times, or drop "
                                              "--times")
        self._check_virtual_stages()
        self._check_zero_bubble()
        self._check_balance()

    def _check_counts(self) -> None:
        """The whole-number knobs within their flags' bounds (an integer, named by its keyword); ``grad_bucket_mb`` a
        size or None."""
        for knob in fields(self):
            given, value = knob.metadata.get(FLAG_KEY), getattr(self, knob.name)
            if not isinstance(given, Flag) or given.parse is not whole_number or given.bounds is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < given.bounds.least:
                raise ConfigError(knob.name, f"must be an integer >= {given.bounds.least:g}, got {value!r}")
            given.bounds.check(given.option, value)
        bucket = self.grad_bucket_mb
        if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, (int, float))
                                   or not bucket > 0):
            raise ConfigError("grad_bucket_mb", f"must be a size in MB > 0 (25 is DDP's), or None for one "
                              f"all-reduce per stage after all backwards; got {bucket!r}")

    def _normalise_choices(self) -> None:
        """The choice knobs become their Enum members (``"square"`` -> ``SliceMethod.SQUARE``); zbv's two chunks."""
        object.__setattr__(self, "slice_method", as_slice_method(self.slice_method))
        object.__setattr__(self, "schedule", as_schedule_kind(self.schedule))
        if self.schedule is ScheduleKind.ZBV and self.virtual_stages == 1:
            object.__setattr__(self, "virtual_stages", 2)   # the V: two chunks on every position
        object.__setattr__(self, "precision", parse_choice(PrecisionMode, self.precision, "precision",
                                                           f"one of {', '.join(PRECISIONS)}"))
        object.__setattr__(self, "checkpoint_activations",
                           as_checkpoint_setting(self.checkpoint_activations))

    def _check_recompute(self) -> None:
        """Activation recomputation with the knobs it does not combine with."""
        if self.checkpoint_activations is not None and self.halo_d2:
            raise ConfigError("checkpoint_activations", "fused halos (halo_d2) already recompute "
                              "border rows inside their blocks and are not combined with activation "
                              "recomputation; use one of checkpoint_activations or halo_d2")
        if self.checkpoint_activations is not None and self.sync_batchnorm:
            raise ConfigError("checkpoint_activations", "with sync_batchnorm the recomputed forward "
                              "would repeat BatchNorm reductions across data-parallel copies whose "
                              "backwards do not run in lockstep; use one of checkpoint_activations "
                              "or sync_batchnorm")

    def _check_stages(self) -> None:
        """The spatial stages among the stages, and what they need."""
        if self.spatial_size > self.split_size:
            raise ConfigError("spatial_size", f"{self.spatial_size} spatial stages do not fit in split_size="
                              f"{self.split_size} stages; use spatial_size <= {self.split_size} (equal: every "
                              f"stage spatial, the loss on tiles: dense models) or split_size >= "
                              f"{self.spatial_size + 1}")
        if self.all_spatial and self.local_dp > 1:
            raise ConfigError("local_dp", f"local_dp copies the layer-parallel stages, and with spatial_size = "
                              f"split_size = {self.split_size} every stage is spatial; use local_dp=1 (and "
                              f"data_parallel for more replicas)")
        if self.spatial_size > 0 and self.num_spatial_parts < 2 and self.grid is None:
            raise ConfigError("num_spatial_parts", "a spatial stage needs at least 2 tiles; "
                              "use num_spatial_parts >= 2 or spatial_size=0")

    def _check_tile_grid(self) -> None:
        """A volume's DxRxC, an explicit grid or the square layout holds num_spatial_parts tiles."""
        if self.volume_grid is not None:
            tiles = math.prod(self.volume_grid)
            if len(self.volume_grid) != 3 or min(self.volume_grid) < 1 or tiles != self.num_spatial_parts:
                shown = "x".join(map(str, self.volume_grid))
                raise ConfigError("slice_method", f"{shown} has {tiles} tiles but num_spatial_parts="
                                  f"{self.num_spatial_parts}; use num_spatial_parts={tiles} or a DxRxC whose "
                                  f"product is {self.num_spatial_parts}")
        elif self.grid is not None:
            rows, cols = self.grid
            if rows < 1 or cols < 1 or rows * cols != self.num_spatial_parts:
                raise ConfigError("grid", f"grid {rows}x{cols} has {rows * cols} tiles but "
                                  f"num_spatial_parts={self.num_spatial_parts}; use a rows x cols "
                                  f"grid whose product is num_spatial_parts")
        elif self.spatial_size > 0 and self.slice_method is SliceMethod.SQUARE:
            p = self.num_spatial_parts
            if math.isqrt(p) ** 2 != p:
                raise ConfigError("num_spatial_parts", f"slice_method='square' needs a perfect "
                                  f"square number of parts, got {p}; use "
                                  f"num_spatial_parts={_nearest_square(p)} or "
                                  f"slice_method='vertical'/'horizontal'")

    def _check_balance(self) -> None:
        """One layer count per stage, each at least 1."""
        if self.balance is not None:
            if len(self.balance) != self.split_size:
                raise ConfigError("balance", f"has {len(self.balance)} entries but split_size="
                                  f"{self.split_size}; give one layer count per stage")
            if any(b < 1 for b in self.balance):
                raise ConfigError("balance", f"every stage needs at least one layer, got "
                                  f"{list(self.balance)}")

    def _check_virtual_stages(self) -> None:
        """The interleaved and V-shaped schedules' knobs: what they can lay out and order (refused with the way out)."""
        chunked = self.schedule.places_chunks
        v = self.virtual_stages
        if chunked != (v > 1):
            raise ConfigError("virtual_stages", f"virtual_stages={v} with schedule='{self.schedule}': "
                              "the interleaved schedule needs virtual_stages >= 2 and is, with zbv, the only "
                              "one that places several chunks per rank; use schedule='interleaved' with "
                              "virtual_stages >= 2, or virtual_stages=1")
        if not chunked:
            return
        name = f"schedule='{self.schedule}'"
        if self.schedule is ScheduleKind.ZBV and v != 2:
            raise ConfigError("virtual_stages", f"{name} holds exactly 2 chunks per rank (down, then back up), "
                              f"virtual_stages={v}; use virtual_stages=2 (or leave it out) or "
                              f"schedule='interleaved' for {v} chunks")
        positions = self.split_size // v
        if self.split_size % v or positions < 2:
            raise ConfigError("split_size" if self.schedule is ScheduleKind.ZBV else "virtual_stages",
                              f"{name}: split_size={self.split_size} stages do not lie as {v} chunks on each "
                              f"of >= 2 pipeline positions; use split_size a multiple of {v} with "
                              f"split_size >= {2 * v}")
        if self.spatial_size > positions:
            raise ConfigError("spatial_size", f"{name}: spatial stages lie in the first chunk only, "
                              f"{positions} positions hold {self.spatial_size} spatial stages; use "
                              f"spatial_size <= {positions}")
        for knob, off, why in (("times", self.gems, "GEMS mirrors"), ("local_dp", self.local_dp > 1,
                               "local-DP copies"), ("sync_batchnorm", self.sync_batchnorm,
                               "synchronised BatchNorm across copies")):
            if off:
                raise ConfigError(knob, f"{name} does not combine with {why} yet; "
                                  f"use schedule='1f1b' for them, or data_parallel for replicas")
        if self.schedule is ScheduleKind.ZBV:
            if self.parts < positions:
                raise ConfigError("parts", f"{name} needs at least one micro-batch per pipeline position to "
                                  f"fill the V: parts={self.parts} < {positions} positions; use parts >= "
                                  f"{2 * positions} (no bubble at F = I = W) or schedule='1f1b'")
            return
        if self.parts % positions:
            raise ConfigError("parts", f"the interleaved schedule runs micro-batches in groups of the "
                              f"{positions} pipeline positions, parts={self.parts} is not a multiple; "
                              f"use parts in {[positions * k for k in (1, 2, 4)]}")

    def _check_zero_bubble(self) -> None:
        """ZB-H1's limits (refused with the way out; zbv's are the chunked schedules' above)."""
        if self.schedule is not ScheduleKind.ZB1:
            return
        if self.gems:
            raise ConfigError("times", "schedule='zb1' does not combine with GEMS mirrors; use times=0 "
                              "(data_parallel for replicas) or schedule='1f1b' with GEMS")
        if self.parts < self.split_size:
            raise ConfigError("parts", f"schedule='zb1' fills the pipeline's drain with the deferred weight "
                              f"gradients of other micro-batches and needs at least one micro-batch per "
                              f"stage: parts={self.parts} < split_size={self.split_size}; use "
                              f"parts >= {self.split_size} or schedule='1f1b'")

    def validate(self, *, world_size: int | None = None, batch_size: int | None = None,
                 num_layers: int | None = None, image_size: int | Sequence[int] | None = None,
                 min_tile: int | Sequence[int] = 1) -> ParallelConfig:
        """Check the configuration against a launch and a workload; return self or raise ConfigError.

        ``world_size``: ranks actually launched. ``batch_size``: the global batch.
        ``num_layers``: length of the layer list (checked against ``balance``/``split_size``).
        ``image_size``: int or (height, width); each tile must be at least ``min_tile``
        pixels per side (pass the receptive-field need of the spatial stages).
        """
        if world_size is not None and world_size != self.world_size:
            raise ConfigError("world_size", self.world_size_message(world_size))
        if num_layers is not None:
            if self.balance is not None and sum(self.balance) != num_layers:
                raise ConfigError("balance", f"sums to {sum(self.balance)} but the model has "
                                  f"{num_layers} layers; make the entries sum to {num_layers}")
            if num_layers < self.split_size:
                raise ConfigError("split_size", f"{self.split_size} stages need at least as many "
                                  f"layers, the model has {num_layers}; use split_size <= "
                                  f"{num_layers}")
        if batch_size is not None:
            self._check_batch(batch_size)
        if image_size is not None and self.spatial_size > 0:
            self._check_tiles(image_size, min_tile)
        return self

    def world_size_message(self, launched: int) -> str:
        """Explain a launch with the wrong number of ranks."""
        return (f"this configuration needs {self.world_size} ranks "
                f"({self.describe_world()}) but {launched} were launched; "
                f"run with mpiexec -n {self.world_size}")

    def describe_world(self) -> str:
        """The rank-count formula with this configuration's numbers."""
        sp = self.spatial_size * self.num_spatial_parts
        lp = (self.pipeline_positions - self.spatial_size) * self.local_dp
        positions = (f"split_size {self.split_size}" if self.virtual_stages == 1 else
                     f"split_size {self.split_size} / virtual_stages {self.virtual_stages}")
        text = (f"spatial_size {self.spatial_size} x num_spatial_parts {self.num_spatial_parts}"
                f" + ({positions} - spatial_size {self.spatial_size}) x local_dp "
                f"{self.local_dp} = {sp} + {lp}")
        if self.data_parallel > 1:
            text = f"({text}) x data_parallel {self.data_parallel}"
        return text

    def _check_batch(self, batch_size: int) -> None:
        if batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {batch_size}")
        divisor = self.batch_divisor
        if batch_size % divisor == 0:
            return
        pieces = [f"data_parallel {self.data_parallel}"] if self.data_parallel > 1 else []
        pieces += [f"2 x times {self.times} GEMS chunks"] if self.gems else []
        pieces += [f"local_dp {self.local_dp}"] if self.local_dp > 1 else []
        pieces.append(f"parts {self.parts}")
        lower = (batch_size // divisor) * divisor
        sizes = " or ".join(str(v) for v in (lower, lower + divisor) if v > 0)
        hint = f"use batch_size {sizes}"
        outer = divisor // self.parts
        if self.parts > 1 and batch_size % outer == 0:
            good = [d for d in _divisors(batch_size // outer)]
            hint += f", or parts in {good}"
        knob = "parts" if self.parts > 1 else "batch_size"
        raise ConfigError(knob, f"batch_size {batch_size} does not split evenly into "
                          f"{' x '.join(pieces)} = {divisor} pieces; {hint}")

    def _check_tiles(self, image_size: int | Sequence[int], min_tile: int | Sequence[int]) -> None:
        if self.volume_grid is not None:
            self._check_volume_tiles(image_size, min_tile)
            return
        height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
        need_h, need_w = (min_tile, min_tile) if isinstance(min_tile, int) else min_tile
        rows, cols = self.grid_shape
        tile_h, tile_w = height // rows, width // cols
        for extent, need, count, name in ((tile_h, need_h, rows, "rows"),
                                          (tile_w, need_w, cols, "columns")):
            if extent < max(1, need):
                fit = max(1, (height if name == "rows" else width) // max(1, need))
                raise ConfigError("num_spatial_parts", f"{count} tile {name} of a "
                                  f"{height}x{width} image are {extent} px, smaller than the "
                                  f"{need} px the layers' receptive field needs; use at most "
                                  f"{fit} tile {name}, a larger image_size, or another "
                                  f"slice_method")

    def _check_volume_tiles(self, image_size: int | Sequence[int], min_tile: int | Sequence[int]) -> None:
        """Each 3-D tile of a ``(depth, height, width)`` volume (an int: a cube) at least ``min_tile`` per axis."""
        sizes = (image_size,) * 3 if isinstance(image_size, int) else tuple(image_size)
        needs = (min_tile,) * 3 if isinstance(min_tile, int) else tuple(min_tile)
        assert self.volume_grid is not None
        shown_grid = "x".join(map(str, self.volume_grid))
        if len(sizes) != 3 or len(needs) != 3:
            raise ConfigError("image_size", f"slice_method {shown_grid} tiles volumes: give image_size as "
                              f"depth,height,width (or one side of a cube), got {image_size!r}")
        shown = "x".join(map(str, sizes))
        for size, need, count, name in zip(sizes, needs, self.volume_grid, ("depth", "rows", "cols")):
            if size // count < max(1, need):
                raise ConfigError("num_spatial_parts", f"{count} tiles along {name} of a {shown} volume are "
                                  f"{size // count} voxels, fewer than the {max(1, need)} the layers need; use at "
                                  f"most {max(1, size // max(1, need))} tiles along {name} in slice_method "
                                  f"{shown_grid}, or a larger image_size")
