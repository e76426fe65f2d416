"""The planner: per-rank memory and step-time models of a configuration, ``suggest`` and live auto-tune.

The public names live here (``dl.planner.estimate_memory(...)``); the modules behind them:
``profile`` (layer shapes and FLOPs), ``live_bytes`` + ``fake_world`` + ``footprint``
(what a stage allocates, simulated on ``meta``), ``optimizer``, ``memory`` (the per-rank
memory model), ``measure`` (measured peaks and step times).
"""

from .measure import measure_engine_step, measure_peak_bytes, measure_step_memory, time_engine_steps
from .memory import MemoryPlan, Precision, RankMemory, Recompute, estimate_memory, memory_table
from .profile import LayerProfile, profile_layers

__all__ = ["LayerProfile", "MemoryPlan", "Precision", "RankMemory", "Recompute", "estimate_memory",
           "measure_engine_step", "measure_peak_bytes", "measure_step_memory", "memory_table",
           "profile_layers", "time_engine_steps"]
