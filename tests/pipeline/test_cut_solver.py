"""One min-max partition solver (issue 87): ``default_cut.partition_stages`` gives, over many random cases, what
the two it replaced gave (copied below as they were at e00234e): ``stages.partition_costs`` (costs per layer, ties
to lighter later stages: ``auto_balance``'s) and the former ``partition_stages`` (a stage cost, ties to shorter
first stages: the default cut's, ``stage_draws``' and the planner's through it)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from itertools import accumulate

import pytest

from mpi4dl_nb.config import ConfigError
from mpi4dl_nb.pipeline import default_cut
from mpi4dl_nb.pipeline.default_cut import auto_balance, partition_stages

StageCost = Callable[[int, int, int], float]
CASES = 2000


# ----------------------------------------------------------------- the two solvers as they were
def old_counts_from_cuts(cut: list[list[int]], split_size: int, num_layers: int) -> tuple[int, ...]:
    counts, i = [], num_layers
    for k in range(split_size, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def old_partition_costs(costs: Sequence[float], split_size: int) -> tuple[int, ...]:
    n = len(costs)
    if not 1 <= split_size <= n:
        raise ConfigError("split_size", f"cannot cut {n} layers into {split_size} stages; "
                          f"use split_size between 1 and {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(split_size + 1)]
    cut = [[0] * (n + 1) for _ in range(split_size + 1)]
    best[0][0] = 0.0
    for k in range(1, split_size + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    return old_counts_from_cuts(cut, split_size, n)


def old_partition_stages(num_layers: int, split_size: int, cost: StageCost) -> tuple[int, ...]:
    if not 1 <= split_size <= num_layers:
        raise ConfigError("split_size", f"cannot cut {num_layers} layers into {split_size} stages; "
                          f"use split_size between 1 and {num_layers}")
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(split_size + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(split_size + 1)]
    best[0][0] = 0.0
    for k in range(1, split_size + 1):
        for i in range(k, num_layers - (split_size - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[split_size][num_layers] == inf:
        raise ConfigError("balance", f"no cut of {num_layers} layers into {split_size} stages "
                          f"is allowed; give balance explicitly")
    return old_counts_from_cuts(cut, split_size, num_layers)


# ----------------------------------------------------------------- random cases
def random_costs(rng: random.Random) -> list[float]:
    """Layer costs: small integers (many ties), bytes, or seconds."""
    n = rng.randint(1, 12)
    kind = rng.choice(["ties", "bytes", "seconds"])
    if kind == "ties":
        return [float(rng.randint(0, 3)) for _ in range(n)]
    if kind == "bytes":
        return [float(rng.choice([0, 1, 2, 4]) * 2 ** rng.randint(10, 30)) for _ in range(n)]
    return [rng.uniform(1e-5, 1e-2) for _ in range(n)]


def random_stage_cost(rng: random.Random, num_layers: int, split: int) -> StageCost:
    """A stage cost like the default cut's: by stage and layers, some forbidden (``inf``), often tied."""
    forbid = rng.choice([0.0, 0.2, 0.6])
    table = {(stage, start, stop): math.inf if rng.random() < forbid else float(rng.randint(0, 4) * (stop - start))
             for stage in range(split) for start in range(num_layers) for stop in range(start + 1, num_layers + 1)}
    return lambda stage, start, stop: table[stage, start, stop]


def worst(cost: StageCost, counts: tuple[int, ...]) -> float:
    """The largest stage cost of the cut ``counts``."""
    bounds = [0, *accumulate(counts)]
    return max(cost(stage, a, b) for stage, (a, b) in enumerate(zip(bounds, bounds[1:])))


def outcome(solve: Callable[..., tuple[int, ...]], *args: object, **kwargs: object) -> tuple[int, ...] | str:
    """``solve(*args, **kwargs)``'s cut, or its refusal's text."""
    try:
        return solve(*args, **kwargs)
    except ConfigError as error:
        return str(error)


def test_auto_balance_cuts_as_partition_costs_did_ties_and_all(monkeypatch):
    rng = random.Random(87)
    differ = 0
    for _ in range(CASES):
        costs = random_costs(rng)
        split = rng.randint(1, len(costs) + 1)
        monkeypatch.setattr(default_cut, "profile_layer_memory", lambda layers, sample, costs=costs: costs)
        new = outcome(auto_balance, [], None, split, by="memory")
        assert new == outcome(old_partition_costs, costs, split), (costs, split)
        differ += new != outcome(old_partition_stages, len(costs), split, lambda s, a, b, c=costs: sum(c[a:b]))
    assert differ > CASES // 10   # the tie-break matters: auto_balance must keep its own


@pytest.mark.parametrize("later_lighter", [False, True])
def test_the_solver_on_stage_costs_cuts_as_the_former_partition_stages(later_lighter):
    rng = random.Random(1 + later_lighter)
    for _ in range(CASES):
        num_layers = rng.randint(1, 10)
        split = rng.randint(1, num_layers + 1)
        cost = random_stage_cost(rng, num_layers, split)
        old = outcome(old_partition_stages, num_layers, split, cost)
        new = outcome(partition_stages, num_layers, split, cost, later_lighter)
        if not later_lighter:
            assert new == old, (num_layers, split)
        elif isinstance(old, str):   # the other tie-break: the same refusal where no cut is allowed
            assert new == old
        else:                        # else a cut as good
            assert isinstance(new, tuple) and len(new) == split and sum(new) == num_layers and min(new) >= 1
            assert worst(cost, new) == worst(cost, old)
