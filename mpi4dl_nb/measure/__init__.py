"""Measuring on the ranks: peak memory and time of steps, network calibration, per-rank run metrics, trials."""
