"""ZeRO: training state sharded over each group of ranks holding the same weights, behind one seam."""
