"""The notebook side: the ipyparallel MPI cluster, the planner, drawings, widgets and ``make demo``."""
