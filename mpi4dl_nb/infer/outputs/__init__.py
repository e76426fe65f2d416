"""Inference outputs: each kind of file a run writes from its probability map, and what those files share."""
