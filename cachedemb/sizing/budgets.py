"""A range of device budgets: the split at each, the curve of predicted PCIe bytes and hit rate against budget
bytes, and its knee (where more budget stops paying).

The curves are computed once (`plan._prepare`) and each budget is split over them in ascending order; a split
refines the curves around its choice and every later split sees those points too, so a larger budget is split
over a superset of a smaller one's options: its predicted bytes per step are never higher (the split minimizes
them, optimal unless the node limit is hit). The hit rate counts rows, not bytes, so with tables of different
row sizes it can dip slightly where bytes still fall.

The knee (docs/sizing.md): on the curve of predicted PCIe bytes per step against log2(budget), both axes scaled
to [0, 1] over the range, the budget farthest below the chord from the first budget to the last. Budgets grow
by doublings, so this is where the bytes saved per doubling fall off most sharply; none when fewer than three
budgets fit or none lies below the chord (the curve falls at least as fast at the top: widen the range).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import numpy as np

from cachedemb.sizing import plan as _plan
from cachedemb.sizing.plan import SizingPlan, parse_bytes

#: Budgets one range may hold (each is a split and a shared-cache simulation per group).
MAX_BUDGETS = 64


def parse_budgets(text) -> list[int]:
    """Budget bytes, ascending, from ``"8GiB"`` (one), ``"LO:HI"`` (LO, 2·LO, 4·LO, ... while below HI, then HI),
    ``"LO:HI:N"`` (N budgets evenly spaced in log scale, LO and HI included) or ``"A,B,C"`` (a list); sizes as
    `parse_bytes` reads them."""
    s = str(text).strip()
    if "," in s and ":" in s:
        raise ValueError(f"budget {text!r}: expected one size (8GiB), a range LO:HI or LO:HI:N, or a list A,B,C; "
                         "not a mix")
    if "," in s:
        out = sorted({parse_bytes(p) for p in s.split(",") if p.strip()})
    elif ":" in s:
        parts = s.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"budget {text!r}: a range is LO:HI (doublings) or LO:HI:N (N budgets)")
        lo, hi = parse_bytes(parts[0]), parse_bytes(parts[1])
        if not 0 < lo < hi:
            raise ValueError(f"budget {text!r}: a range needs 0 < LO < HI, got {lo} and {hi} bytes")
        if len(parts) == 3:
            try:
                n = int(parts[2])
            except ValueError:
                n = 0
            if not 2 <= n <= MAX_BUDGETS:
                raise ValueError(f"budget {text!r}: N must be an integer in [2, {MAX_BUDGETS}], got {parts[2]!r}")
            out = sorted({int(round(b)) for b in np.geomspace(lo, hi, n)} | {lo, hi})
        else:
            steps = int(math.floor(math.log2(hi / lo) + 1e-9))
            out = sorted({lo << k for k in range(steps + 1)} | {hi})
    else:
        out = [parse_bytes(s)]
    if not out or out[0] < 1:
        raise ValueError(f"budget {text!r}: budgets must be positive byte sizes")
    if len(out) > MAX_BUDGETS:
        raise ValueError(f"budget {text!r} gives {len(out)} budgets; at most {MAX_BUDGETS} (use LO:HI:N)")
    return out


def knee_index(budgets, values) -> int | None:
    """Index of the knee of ``values`` (falling) against log2(``budgets``): with both scaled to [0, 1], the point
    farthest below the chord from the first point to the last; None if there are fewer than 3 points, the
    values are flat, or no point lies below the chord."""
    x, y = np.log2(np.asarray(budgets, dtype=np.float64)), np.asarray(values, dtype=np.float64)
    if x.size < 3 or x[-1] <= x[0] or np.ptp(y) <= 1e-12 * max(1.0, float(np.abs(y).max())):
        return None
    u, v = (x - x[0]) / (x[-1] - x[0]), (y - y.min()) / np.ptp(y)
    below = (v[0] + (v[-1] - v[0]) * u) - v  # the chord's height at u minus the curve's
    k = int(np.argmax(below[1:-1])) + 1
    return k if below[k] > 1e-9 else None


@dataclass(frozen=True)
class BudgetPoint:
    """One budget of the range: what the split predicts for it (each table's own cache of its rows) and what
    the module's shared caches are predicted to do at those rows."""

    budget_bytes: int
    budget_used: int
    pcie_bytes_per_step: float  # the split's: Σ tables' rows moved per step × bytes per moved row
    hit_rate: float  # the split's: 1 - Σ rows moved / Σ distinct ids per step
    shared_pcie_bytes_per_step: float  # the caches the module builds (collection groups), simulated
    shared_hit_rate: float

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "budget_used": self.budget_used,
                "pcie_bytes_per_step": round(self.pcie_bytes_per_step, 1), "hit_rate": round(self.hit_rate, 6),
                "shared_pcie_bytes_per_step": round(self.shared_pcie_bytes_per_step, 1),
                "shared_hit_rate": round(self.shared_hit_rate, 6)}


@dataclass
class BudgetCurve:
    """The split at each budget of a range that fits (`points`, `plans`), the budgets below the smallest caches
    (`too_small`), the budget past which nothing changes (`whole_bytes`) and the knee (`knee`, an index into
    `points`, or None)."""

    points: list[BudgetPoint]
    plans: list[SizingPlan]
    too_small: list[int]
    least_bytes: int
    whole_bytes: int
    knee: int | None
    extra: dict = field(default_factory=dict)

    @property
    def chosen(self) -> int:
        """The budget to use: the knee's, else the largest that fits."""
        return self.knee if self.knee is not None else len(self.points) - 1

    @property
    def chosen_plan(self) -> SizingPlan:
        return self.plans[self.chosen]

    def to_dict(self) -> dict:
        return {"budgets": [p.to_dict() for p in self.points], "too_small": list(self.too_small),
                "least_bytes": self.least_bytes, "whole_bytes": self.whole_bytes,
                "knee": None if self.knee is None else self.points[self.knee].budget_bytes,
                "chosen_budget_bytes": self.points[self.chosen].budget_bytes,
                "knee_rule": "the budget farthest below the chord of PCIe bytes per step against log2(budget), "
                             "both scaled to [0, 1]",
                "plan": self.chosen_plan.to_dict()}


def _point(p: SizingPlan) -> BudgetPoint:
    unique = sum(t.curve.unique_per_batch for t in p.tables)
    moved = sum(t.rows_per_batch for t in p.tables)
    return BudgetPoint(p.budget_bytes, p.budget_used, float(p.split.bytes_moved),
                       1.0 - moved / unique if unique else float("nan"), float(p.pcie_bytes_per_step),
                       float(p.hit_rate))


def plan_range(source, budgets, tables=None, **options) -> BudgetCurve:
    """The split at each of ``budgets`` (bytes, or a string for `parse_budgets`), over curves computed once.

    Args:
        source: what `plan` reads (a data directory, id files, arrays, model inputs, traces).
        budgets: device budgets: a list of bytes / sizes, or ``"1MiB:1GiB"``, ``"1MiB:1GiB:12"``, ``"A,B,C"``.
        tables: as `plan`'s.
        **options: `plan`'s keyword arguments (policy, optimizer, batch_size, compare, ...); ``compare`` curves
            are computed for the chosen budget's plan only.
    """
    if isinstance(budgets, str):
        budgets = parse_budgets(budgets)
    budgets = sorted({_plan._check_budget(b) for b in budgets})
    if not budgets:
        raise ValueError("budgets is empty; expected at least one budget")
    bound = inspect.signature(_plan.plan).bind(source, budgets[0], tables, **options)
    bound.apply_defaults()
    kw = dict(bound.arguments)
    compare = tuple(kw.pop("compare"))
    for name in ("source", "budget_bytes", "tables"):
        kw.pop(name)
    ctx = _plan._prepare(source, tables, compare=compare, **kw)
    fit = [b for b in budgets if b >= ctx.least_bytes]
    if not fit:
        raise ValueError(f"every budget ({', '.join(str(b) for b in budgets)} bytes) is below the smallest caches "
                         f"the tables allow ({ctx.least_bytes} bytes: each table at least its largest batch's "
                         "distinct ids, or min_rows); raise the budgets")
    plans = [_plan._plan_at(ctx, b) for b in fit]
    points = [_point(p) for p in plans]
    knee = knee_index([p.budget_bytes for p in points], [p.pcie_bytes_per_step for p in points])
    curve = BudgetCurve(points, plans, [b for b in budgets if b < ctx.least_bytes], ctx.least_bytes,
                        ctx.whole_bytes, knee)
    _plan._add_compare(ctx, curve.chosen_plan, compare)
    return curve


__all__ = ["BudgetCurve", "BudgetPoint", "MAX_BUDGETS", "knee_index", "parse_budgets", "plan_range"]
