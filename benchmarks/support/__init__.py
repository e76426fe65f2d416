"""What the benchmark scripts share: the machine-and-load footer, timing, tables, world-size guards, launches, models.

Scripts run as ``python benchmarks/bench_x.py`` import it as ``support``; tests import it as
``benchmarks.support`` (its modules import each other relatively, so both work).
"""
