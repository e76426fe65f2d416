"""The planner: per-rank memory and step-time models of a configuration, ``suggest`` and live auto-tune.

The public names live here (``dl.planner.estimate_memory(...)``); the modules behind them: ``profile`` (layer shapes
and FLOPs), ``footprint`` + ``meta_count`` + ``tile_footprints`` + ``stage_compose`` with ``live_bytes`` and
``fake_world`` (what a stage allocates, simulated on ``meta``), ``optimizer``, ``memory`` (the per-rank memory model),
``timing`` + ``simulate`` + ``step_time`` (the time model), ``suggest``, ``tune`` (live auto-tune); measurement lives
in ``measure`` (it runs on the ranks).
"""

from ..measure.steps import measure_engine_step, measure_peak_bytes, measure_step_memory, time_engine_steps
from .layer_timer import LayerTimer
from .memory import MemoryPlan, Precision, RankMemory, Recompute, estimate_memory, memory_table
from .profile import LayerProfile, profile_layers
from .step_time import TimePlan, predict_step_time
from .suggest import (
    Refusal,
    Suggestion,
    Suggestions,
    candidate_configs,
    canonical,
    describe_config,
    one_knob_variants,
    suggest,
)
from .timing import Network, Node, calibrate_network, fit_network, network_of

__all__ = ["LayerProfile", "LayerTimer", "Network", "Node", "Refusal", "Suggestion", "Suggestions",
           "TimePlan", "calibrate_network", "candidate_configs", "canonical", "describe_config", "fit_network",
           "network_of", "one_knob_variants",
           "predict_step_time", "suggest", "MemoryPlan", "Precision", "RankMemory", "Recompute", "estimate_memory",
           "measure_engine_step", "measure_peak_bytes", "measure_step_memory", "memory_table",
           "profile_layers", "time_engine_steps"]
