"""Live auto-tune: the planner's top configurations run a few steps each on the live ranks,
side by side with their steps interleaved, predicted next to measured, and the fastest one
that fits is picked.

``Tuner`` drives it through ``run(function, *args)``, which calls one of the collective
functions of ``measure.trials`` on every rank and returns rank 0's result - ``cluster.run`` from a
notebook (``Tuner.on_cluster``), or the ranks themselves in ``python -m mpi4dl_nb tune``
(``measure.trials.here``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, TypeVar, Unpack

from ..config import ParallelConfig
from ..measure.calibration import JobCalibration
from ..measure.trials import (
    Measured,
    Runner,
    TrialModel,
    calibrate_job_on_engine,
    device_on_engine,
    measure_interleaved,
)
from ..pipeline.actions import ActionKind
from .device import MeasuringDevice
from .layer_timer import measuring_device
from .memory import MB, estimate_memory
from .step_time import TimePlan, step_model, time_layers
from .suggest import KNOB_VALUES, Suggestion, Suggestions, SuggestOptions, describe_config, one_knob_variants, suggest
from .timing import Network, Node, network_of

R = TypeVar("R")   # what a function run on every rank returns


class EngineCluster(Protocol):
    """What a live auto-tune needs of a notebook cluster (``notebook.cluster.Cluster``): its
    ranks, and a call of a function on every one of them, results by rank."""

    @property
    def ranks(self) -> Sequence[object]: ...

    def run(self, func: Callable[..., R], *args: object, timeout: float | None = None) -> list[R]: ...


class TunerOptions(TypedDict, total=False):
    """``Tuner``'s settings besides what it tunes (``Tuner.on_cluster`` passes them on)."""

    top: int
    steps: int
    rounds: int
    suggest_options: SuggestOptions
    threads: int | None


@dataclass
class TuneRow:
    """One configuration (None: one process) predicted and, once run, measured."""

    label: str
    cfg: ParallelConfig | None
    predicted_seconds: float
    predicted_peak: int
    measured: Measured | None = None
    suggestion: Suggestion | None = None
    plan: TimePlan | None = None       # the prediction per rank (``explain``)

    @property
    def ratio(self) -> float | None:
        """Predicted / measured step time."""
        return self.predicted_seconds / self.measured.seconds if self.measured else None

    def fits(self, limit: float) -> bool:
        return self.measured is not None and self.measured.peak <= limit


@dataclass
class TuneResult:
    """Every row of an auto-tune (one process first, then the candidates in suggest's order)."""

    limit: float
    rows: list[TuneRow]
    network: Network
    suggestions: Suggestions | None = None

    @property
    def candidates(self) -> list[TuneRow]:
        return [row for row in self.rows if row.cfg is not None]

    @property
    def best(self) -> TuneRow | None:
        """The fastest measured candidate whose every rank fits the limit."""
        fitting = [row for row in self.candidates if row.fits(self.limit)]
        return min(fitting, key=lambda row: row.measured.seconds if row.measured else float("inf")) if fitting else None

    @property
    def suggested(self) -> TuneRow | None:
        """Suggest's first choice (the fastest predicted)."""
        return self.candidates[0] if self.candidates else None

    def table(self) -> str:
        """Predicted and measured side by side, aligned (MB, seconds)."""
        headers = ["#", "configuration", "ranks", "pred s", "meas s", "pred/meas", "pred MB", "meas MB",
                   "fits"]
        rows = []
        for index, row in enumerate(self.rows):
            measured = row.measured
            rows.append([
                "-" if row.cfg is None else str(index), row.label,
                "1" if row.cfg is None else str(row.cfg.world_size), f"{row.predicted_seconds:.3f}",
                f"{measured.seconds:.3f}" if measured else "...",
                f"{row.ratio:.2f}" if row.ratio is not None else "",
                f"{row.predicted_peak / MB:.1f}", f"{measured.peak / MB:.1f}" if measured else "...",
                ("yes" if row.fits(self.limit) else "no") if measured else ""])
        lines = aligned([headers, *rows], left=1)
        best, first = self.best, self.suggested
        if best is not None and best.measured is not None:
            lines.append(f"picked: {best.label} ({best.measured.seconds:.3f} s/step measured, "
                         f"peak {best.measured.peak / MB:.1f} MB <= {self.limit / MB:.1f} MB)")
            if self.suggestions is not None and first is not None and first.measured is not None:
                lines.append(f"suggest's first choice measured {first.measured.seconds:.3f} s: "
                             f"{first.measured.seconds / best.measured.seconds:.2f}x the best")
        elif self.candidates and all(r.measured for r in self.candidates):
            lines.append(f"no candidate fits {self.limit / MB:.1f} MB as measured")
        return "\n".join(lines)

    def explain(self) -> str:
        """Per measured configuration, each rank's predicted and traced seconds per step by action
        kind (a phase runs from the end of the rank's previous action, so waits for partners and
        messages count in it), and the largest gap: which part of a prediction is off."""
        blocks = [explain_row(row) for row in self.candidates if row.measured is not None and row.plan is not None]
        return "\n\n".join(block for block in blocks if block)

    def as_dict(self) -> dict[str, object]:
        return {"limit_mb": self.limit / MB, "network": {"latency": self.network.latency,
                                                          "bandwidth": self.network.bandwidth},
                "rows": [{"label": r.label, "config": r.cfg.as_dict() if r.cfg else None,
                          "predicted_seconds": r.predicted_seconds, "predicted_peak_mb": r.predicted_peak / MB,
                          "measured_seconds": r.measured.seconds if r.measured else None,
                          "measured_step_seconds": list(r.measured.step_seconds) if r.measured else None,
                          "measured_peak_mb": [p / MB for p in r.measured.peaks] if r.measured else None,
                          "predicted_phases": [t.phases for t in r.plan.ranks] if r.plan else None,
                          "measured_phases": list(r.measured.phases) if r.measured else None,
                          "fits": r.fits(self.limit)} for r in self.rows],
                "picked": self.best.cfg.as_dict() if self.best and self.best.cfg else None}


def aligned(rows: list[list[str]], left: int | None = None) -> list[str]:
    """``rows`` of cells (the first: headers) as lines of aligned columns, column ``left``
    left-aligned and the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]


SHOWN_PHASE = 5e-4     # seconds: a phase shorter than this on every rank, predicted and traced, is left out


def explain_row(row: TuneRow) -> str:
    """``TuneResult.explain`` of one row: a table of ``predicted/traced`` seconds per rank and
    action kind, then the largest gap; empty when the row has no plan, or was not traced."""
    if row.plan is None or row.measured is None or not row.measured.phases:
        return ""
    predicted = [t.phases for t in row.plan.ranks]
    traced = row.measured.phases
    kinds = [kind.value for kind in ActionKind
             if any(max(p.get(kind.value, 0.0), m.get(kind.value, 0.0)) >= SHOWN_PHASE
                    for p, m in zip(predicted, traced))]
    headers = ["rank", *kinds, "sum"]
    cells = [[str(rank), *(f"{p.get(k, 0.0):.3f}/{m.get(k, 0.0):.3f}" for k in kinds),
              f"{sum(p.values()):.3f}/{sum(m.values()):.3f}"] for rank, (p, m) in enumerate(zip(predicted, traced))]
    lines = [f"{row.label}: {row.predicted_seconds:.3f} s predicted, {row.measured.seconds:.3f} s measured "
             "(predicted/traced seconds per step)", *aligned([headers, *cells])]
    if kinds:
        _, rank, kind = max((abs(p.get(k, 0.0) - m.get(k, 0.0)), r, k)
                            for r, (p, m) in enumerate(zip(predicted, traced)) for k in kinds)
        p, m = predicted[rank].get(kind, 0.0), traced[rank].get(kind, 0.0)
        lines.append(f"largest gap: rank {rank} {kind}, {p:.3f} s predicted against {m:.3f} s traced")
    return "\n".join(lines)


@dataclass
class Tuner:
    """One auto-tune of ``spec`` at ``image_size``/``batch_size`` under ``memory_limit`` bytes
    per rank on ``devices`` ranks: ``top`` candidates, built side by side and timed in
    ``rounds`` rounds of ``steps`` interleaved steps each (``measure.trials.measure_interleaved``:
    the machine's slow spells fall on every row alike); a row's time is the median of its steps.
    Predictions measure layer times and copy speed on the ranks' device (``device``: learnt by
    ``calibrate``, else asked of the ranks), through ``measure_on`` (``layer_timer.measuring_device``)."""

    spec: TrialModel
    image_size: int
    batch_size: int
    memory_limit: float
    devices: int
    run: Runner
    top: int = 3
    steps: int = 2
    rounds: int = 1
    suggest_options: SuggestOptions = field(default_factory=SuggestOptions)
    result: TuneResult | None = None
    threads: int | None = None      # torch threads of each rank, learnt by ``calibrate``
    device: str | None = None       # the ranks' device, learnt by ``calibrate``
    measure_on: Callable[[str], MeasuringDevice] = measuring_device

    @classmethod
    def on_cluster(cls, cluster: EngineCluster, spec: TrialModel, image_size: int, batch_size: int,
                   memory_limit: float, timeout: float = 1800.0, **options: Unpack[TunerOptions]) -> Tuner:
        """A Tuner whose measurements run on an ipyparallel ``cluster`` (all its engines)."""
        def run(function: Callable[..., R], *args: object) -> R:
            return cluster.run(function, *args, timeout=timeout)[0]
        return cls(spec, image_size, batch_size, memory_limit, len(cluster.ranks), run, **options)

    def plan(self, network: Network) -> TuneResult:
        """suggest with the calibrated network; the rows to measure (nothing measured yet)."""
        layers = self.spec.build()
        found = suggest(layers, self.image_size, self.memory_limit, self.devices, batch_size=self.batch_size,
                        dtype=self.spec.torch_dtype, network=network, device=self.measuring(), top=self.top,
                        threads=self.threads, **self.suggest_options)
        serial = found.serial_time
        rows = [TuneRow("one process", None, serial.seconds if serial else float("nan"),
                        found.serial_memory.peak)]
        rows += [TuneRow(describe_config(s.cfg), s.cfg, s.est_step_time, s.peak_bytes, suggestion=s, plan=s.time)
                 for s in found]
        self.result = TuneResult(self.memory_limit, rows, network, found)
        return self.result

    def sweep(self, base: ParallelConfig, network: Network | None = None,
              knobs: Sequence[str] = tuple(KNOB_VALUES)) -> TuneResult:
        """The rows of a one-knob sweep around ``base`` (one process, ``base``, then each
        ``one_knob_variants`` of it, labelled by the knob it changes), predicted with
        ``network`` (None: calibrated now); measure them with ``measure`` or ``measure_all``."""
        network = network or self.calibrate()
        layers = self.spec.build()
        dtype = self.spec.torch_dtype
        serial_cfg = ParallelConfig(split_size=1, spatial_size=0)
        configs = [("one process", serial_cfg), (describe_config(base), base)]
        configs += [(f"{knob}={value}", cfg)
                    for knob, value, cfg in one_knob_variants(base, len(layers), self.batch_size, knobs)]
        bench = self.measuring()
        node = Node.measured(bench)       # copy speed measured once, for every row
        models = [step_model(layers, cfg, self.image_size, self.batch_size, dtype=dtype, network=network,
                             node=node, device=bench, threads=None if cfg is serial_cfg else self.threads)
                  for _, cfg in configs]
        time_layers(models)     # every row's layers timed together: a slow spell falls on all alike
        rows = []
        for (label, cfg), found in zip(configs, models):
            peak = estimate_memory(layers, cfg, self.image_size, self.batch_size, dtype=dtype).peak
            plan = found.predict()
            rows.append(TuneRow(label, None if cfg is serial_cfg else cfg, plan.seconds, peak, plan=plan))
        self.result = TuneResult(self.memory_limit, rows, network)
        return self.result

    def measure_all(self, result: TuneResult, progress: Callable[[TuneResult], None] | None = None) -> TuneResult:
        """Measure every row of ``result`` on the ranks, side by side (``measure.trials.measure_interleaved``);
        ``progress(result)`` after each round."""
        def record(found: list[Measured]) -> None:
            for row, measured in zip(result.rows, found):
                row.measured = measured
            if progress is not None:
                progress(result)

        measure_interleaved(self.run, self.spec, [row.cfg.as_dict() if row.cfg is not None else None
                                                  for row in result.rows],
                            self.image_size, self.batch_size, self.steps, self.rounds, record)
        return result

    def calibrate(self) -> Network:
        """The ranks' network (ping-pong, meeting cost); remembers their torch threads and device."""
        return self.calibrated(self.run(calibrate_job_on_engine))

    def calibrated(self, calibration: JobCalibration) -> Network:
        """The network of the ranks' ``calibration``; remembers their torch threads and device."""
        self.threads, self.device = calibration.threads, calibration.device
        return network_of(calibration)

    def measuring(self) -> MeasuringDevice:
        """Where this tune's predictions measure: the ranks' device (asked of them when no
        calibration said it)."""
        if self.device is None:
            self.device = self.run(device_on_engine)
        return self.measure_on(self.device)

    def __call__(self, progress: Callable[[TuneResult], None] | None = None) -> TuneResult:
        """Calibrate, suggest, then measure every row; ``progress(result)`` once planned and after
        each measured round."""
        result = self.plan(self.calibrate())
        if progress is not None:
            progress(result)
        return self.measure_all(result, progress)
