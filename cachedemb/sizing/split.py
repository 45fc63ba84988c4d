"""The budget split: cache rows per table that minimize the predicted bytes moved per step within a byte budget.

The problem: each table t offers sizes c (the points of its miss-ratio curve) at a cost of c × (bytes a cached
row holds in device memory) and a value of (rows moved per step at c) × (bytes a moved row carries); pick one
size per table, total cost <= budget, total value least. That is a multiple-choice knapsack.

How: the lower convex hull of each table's (cost, value) points gives the problem's linear relaxation, solved
greedily (hull segments by bytes saved per byte spent, the last one fractional): the classic marginal-utility
split of cache partitioning (Stone et al.; Talus, Beckmann & Sanchez, HPCA '15), and a lower bound no split can
beat. Branch and bound over the tables with that bound then finds the best split over the curves' own points
(optimal to a relative 1e-6 unless the node limit is hit; `Split.optimal` says which, `lower_bound` how far it
can be off).
Between hull vertices a curve can lie above its hull, so the split never relies on a fractional segment: every
chosen size is a point where the curve was measured.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EPS = 1e-9
#: Relative gap under which a branch cannot improve on the best split found: optimality is proven to this.
REL_TOL = 1e-6


@dataclass(frozen=True)
class TableCost:
    """One table's options: cache ``sizes`` (rows, ascending), the predicted bytes moved per step at each,
    and the budget bytes one cache row costs."""

    name: str
    sizes: np.ndarray
    bytes_moved: np.ndarray
    row_cost: int

    def __post_init__(self):
        sizes, moved = np.asarray(self.sizes, dtype=np.int64), np.asarray(self.bytes_moved, dtype=np.float64)
        if sizes.ndim != 1 or sizes.shape != moved.shape or sizes.size == 0:
            raise ValueError(f"table {self.name!r}: sizes and bytes_moved must be 1-D arrays of the same non-zero "
                             f"length, got {sizes.shape} and {moved.shape}")
        if isinstance(self.row_cost, bool) or int(self.row_cost) < 1:
            raise ValueError(f"table {self.name!r}: row_cost must be a positive number of bytes, got "
                             f"{self.row_cost!r}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "bytes_moved", moved)
        object.__setattr__(self, "row_cost", int(self.row_cost))


@dataclass(frozen=True)
class Split:
    """The chosen rows per table, the predicted bytes moved per step (total), the budget they use, the linear
    relaxation's bound (no split of this budget moves fewer bytes) and whether the search proved optimality."""

    rows: dict[str, int]
    bytes_moved: float
    budget_used: int
    lower_bound: float
    optimal: bool
    nodes: int


def _frontier(t: TableCost, budget: int):
    """The options that fit the budget and are not dominated (cheaper with at most the same value), by cost."""
    order = np.argsort(t.sizes, kind="stable")
    sizes, values = t.sizes[order], t.bytes_moved[order]
    costs = sizes * t.row_cost
    keep_s, keep_c, keep_v = [], [], []
    for s, c, v in zip(sizes, costs, values):
        if c > budget:
            break
        if keep_v and v >= keep_v[-1] - _EPS * max(1.0, abs(keep_v[-1])):
            continue
        keep_s.append(int(s)), keep_c.append(int(c)), keep_v.append(float(v))
    return np.array(keep_s, dtype=np.int64), np.array(keep_c, dtype=np.int64), np.array(keep_v)


def _hull(costs: np.ndarray, values: np.ndarray) -> list[int]:
    """Indices of the lower convex hull's vertices, from the cheapest option to the least value."""
    hull: list[int] = []
    for i in range(costs.size):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above the segment a -> i: drop it
            cross = (costs[b] - costs[a]) * (values[i] - values[a]) - (values[b] - values[a]) * (costs[i] - costs[a])
            if cross <= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


class _Relaxation:
    """The linear relaxation's optimum for the tables i.. with any remaining budget: their cheapest options,
    plus hull segments taken by slope, the last fractionally. O(log segments) per query."""

    def __init__(self, options, order):
        n = len(order)
        self.base_cost = np.zeros(n + 1, dtype=np.int64)
        self.base_value = np.zeros(n + 1)
        self.cum_cost, self.cum_gain, self.slope = [None] * (n + 1), [None] * (n + 1), [None] * (n + 1)
        segments: list[tuple[float, int, float]] = []
        self.cum_cost[n], self.cum_gain[n], self.slope[n] = np.zeros(1), np.zeros(1), np.zeros(0)
        for k in range(n - 1, -1, -1):
            costs, values = options[order[k]][1], options[order[k]][2]
            self.base_cost[k] = self.base_cost[k + 1] + costs[0]
            self.base_value[k] = self.base_value[k + 1] + values[0]
            h = _hull(costs, values)
            for a, b in zip(h[:-1], h[1:]):
                dc, dv = float(costs[b] - costs[a]), float(values[a] - values[b])
                segments.append((dv / dc, dc, dv))
            segments.sort(key=lambda s: -s[0])
            self.slope[k] = np.array([s[0] for s in segments])
            self.cum_cost[k] = np.concatenate([[0.0], np.cumsum([s[1] for s in segments])])
            self.cum_gain[k] = np.concatenate([[0.0], np.cumsum([s[2] for s in segments])])

    def bound(self, k: int, budget: float) -> float:
        """Least value of tables k.. within ``budget`` (-inf-free: budget >= their cheapest options)."""
        spare = budget - self.base_cost[k]
        cum_cost, cum_gain = self.cum_cost[k], self.cum_gain[k]
        j = int(np.searchsorted(cum_cost, spare, side="right")) - 1
        gain = cum_gain[j]
        if j < self.slope[k].size:
            gain += (spare - cum_cost[j]) * self.slope[k][j]
        return float(self.base_value[k] - gain)


def split_budget(tables: list[TableCost], budget_bytes: int, max_nodes: int = 200_000) -> Split:
    """The sizes (one of each table's) minimizing the total bytes moved per step within ``budget_bytes``."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be distinct, got {names}")
    budget = int(budget_bytes)
    options = [_frontier(t, budget) for t in tables]
    need = sum(int(t.sizes.min()) * t.row_cost for t in tables)
    if any(o[0].size == 0 for o in options) or need > budget:
        raise ValueError(f"budget of {budget} bytes is below the smallest caches the tables allow "
                         f"({need} bytes: {', '.join(f'{t.name} {int(t.sizes.min())} rows' for t in tables)})")
    # Tables whose choice matters most first: the bound then prunes early.
    spread = [float(o[2][0] - o[2][-1]) for o in options]
    order = sorted(range(len(tables)), key=lambda i: -spread[i])
    relax = _Relaxation(options, order)
    lower = relax.bound(0, budget)

    # Incumbent: walk the global hull segments by slope, taking each that still fits (a table's segments in
    # order), then spend what is left on each table's best affordable upgrade.
    pick = [0] * len(tables)
    spent = sum(int(o[1][0]) for o in options)
    segs = []
    for i, (_, costs, values) in enumerate(options):
        h = _hull(costs, values)
        segs += [((values[a] - values[b]) / (costs[b] - costs[a]), i, a, b) for a, b in zip(h[:-1], h[1:])]
    frozen = set()
    for _, i, a, b in sorted(segs, key=lambda s: -s[0]):
        if i in frozen or pick[i] != a:
            continue
        extra = int(options[i][1][b] - options[i][1][a])
        if spent + extra <= budget:
            pick[i], spent = b, spent + extra
        else:
            frozen.add(i)
    improved = True
    while improved:
        improved = False
        best_gain, best_move = 0.0, None
        for i, (_, costs, values) in enumerate(options):
            for j in range(pick[i] + 1, costs.size):
                extra = int(costs[j] - costs[pick[i]])
                gain = values[pick[i]] - values[j]
                if spent + extra <= budget and gain > best_gain:
                    best_gain, best_move = gain, (i, j, extra)
        if best_move is not None:
            i, j, extra = best_move
            pick[i], spent, improved = j, spent + extra, True
    best_value = sum(float(options[i][2][pick[i]]) for i in range(len(tables)))
    best_pick = list(pick)

    # Branch and bound: tables in `order`, each table's options from the most rows down.
    nodes = 0
    stack_pick = [0] * len(tables)

    def search(k: int, budget_left: int, value: float) -> None:
        nonlocal nodes, best_value, best_pick
        if nodes >= max_nodes:
            return
        nodes += 1
        if k == len(order):
            if value < best_value:
                best_value, best_pick = value, list(stack_pick)
            return
        i = order[k]
        _, costs, values = options[i]
        rest = int(relax.base_cost[k + 1])
        # children best-first by their own bound, each pruned before it costs a node
        children = []
        for j in range(costs.size):
            left = budget_left - int(costs[j])
            if left >= rest:
                children.append((value + float(values[j]) + relax.bound(k + 1, left), j, left))
        children.sort()
        for child_bound, j, left in children:
            if child_bound >= best_value - REL_TOL * abs(best_value):
                break
            stack_pick[i] = j
            search(k + 1, left, value + float(values[j]))

    search(0, budget, 0.0)
    rows = {tables[i].name: int(options[i][0][best_pick[i]]) for i in range(len(tables))}
    used = sum(int(options[i][1][best_pick[i]]) for i in range(len(tables)))
    return Split(rows=rows, bytes_moved=best_value, budget_used=used, lower_bound=min(lower, best_value),
                 optimal=nodes < max_nodes, nodes=nodes)


__all__ = ["Split", "TableCost", "split_budget"]
