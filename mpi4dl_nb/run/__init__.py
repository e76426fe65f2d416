"""Training runs: the loop with checkpoints and evaluation, resume policy, job monitor, divergence and data checks."""
