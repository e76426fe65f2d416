"""Whole-slide inference: a trained network over a slide, window by window on spatial ranks, exact and streaming."""
