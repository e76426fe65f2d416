"""Evaluation: held-out splits, forward-only passes with the training layout, exact metrics, metrics logs, curves."""
