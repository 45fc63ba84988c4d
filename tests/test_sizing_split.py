"""The budget split against exhaustive search, and its relaxation bound."""
import itertools

import numpy as np
import pytest

from cachedemb.sizing.split import TableCost, split_budget


def exhaustive(tables, budget):
    best, best_rows = None, None
    for combo in itertools.product(*[range(t.sizes.size) for t in tables]):
        cost = sum(int(t.sizes[j]) * t.row_cost for t, j in zip(tables, combo))
        if cost > budget:
            continue
        value = sum(float(t.bytes_moved[j]) for t, j in zip(tables, combo))
        if best is None or value < best - 1e-9:
            best, best_rows = value, {t.name: int(t.sizes[j]) for t, j in zip(tables, combo)}
    return best, best_rows


def random_tables(rng, n):
    tables = []
    for i in range(n):
        sizes = np.unique(rng.integers(1, 60, size=int(rng.integers(1, 8))))
        if rng.random() < 0.7:  # a curve: fewer bytes with more rows, not always convex
            values = np.sort(rng.random(sizes.size) * 100)[::-1]
        else:  # anything, dominated options included
            values = rng.random(sizes.size) * 100
        tables.append(TableCost(f"t{i}", sizes, values, int(rng.integers(1, 9))))
    return tables


def test_split_is_optimal_by_exhaustive_search():
    for seed in range(300):
        rng = np.random.default_rng(seed)
        tables = random_tables(rng, int(rng.integers(1, 5)))
        smallest = sum(int(t.sizes.min()) * t.row_cost for t in tables)
        budget = smallest + int(rng.integers(0, 400))
        split = split_budget(tables, budget)
        best, _ = exhaustive(tables, budget)
        assert split.optimal and split.bytes_moved == pytest.approx(best, rel=1e-6, abs=1e-9), seed
        assert split.budget_used <= budget
        assert split.budget_used == sum(split.rows[t.name] * t.row_cost for t in tables)
        chosen = sum(float(t.bytes_moved[list(t.sizes).index(split.rows[t.name])]) for t in tables)
        assert chosen == pytest.approx(split.bytes_moved)
        assert split.lower_bound <= best + 1e-6


def test_convex_curves_split_where_marginal_savings_equalize():
    # bytes moved = 1000 / (1 + rows): a row is worth more to the table that moves more
    sizes = np.arange(0, 41)
    hot = TableCost("hot", sizes, 4000 / (1 + sizes), 1)
    cold = TableCost("cold", sizes, 1000 / (1 + sizes), 1)
    split = split_budget([hot, cold], 30)
    best, rows = exhaustive([hot, cold], 30)
    assert split.rows == rows and split.rows["hot"] > split.rows["cold"] > 0
    assert split.lower_bound <= split.bytes_moved <= split.lower_bound * 1.01


def test_row_cost_weighs_the_split():
    sizes = np.arange(1, 21)
    same_curve = 100.0 - 4 * sizes
    cheap = TableCost("cheap", sizes, same_curve, 1)
    dear = TableCost("dear", sizes, same_curve, 10)
    split = split_budget([cheap, dear], 40)
    assert split.rows == {"cheap": 20, "dear": 2}


def test_many_tables_finish_with_proof_or_say_so():
    rng = np.random.default_rng(0)
    tables = []
    for i in range(26):
        top = int(10 ** rng.uniform(1, 6))
        sizes = np.unique(np.round(np.geomspace(1, top, 33)).astype(np.int64))
        values = np.minimum.accumulate(1000 * (1 - (np.log(sizes) / np.log(top + 1)) ** rng.uniform(0.6, 1.3))
                                       + rng.random(sizes.size) * 5) * rng.uniform(1, 100)
        tables.append(TableCost(f"t{i}", sizes, values, int(rng.choice([80, 600, 1600]))))
    total = sum(int(t.sizes.max()) * t.row_cost for t in tables)
    split = split_budget(tables, total // 100)
    assert split.optimal and split.budget_used <= total // 100
    capped = split_budget(tables, total // 100, max_nodes=3)
    assert not capped.optimal and capped.bytes_moved >= split.bytes_moved - 1e-6
    assert capped.lower_bound == pytest.approx(split.lower_bound)


def test_bad_arguments_raise():
    t = TableCost("a", np.array([2, 4]), np.array([5.0, 1.0]), 10)
    with pytest.raises(ValueError, match=r"below the smallest caches the tables allow \(20 bytes: a 2 rows\)"):
        split_budget([t], 19)
    with pytest.raises(ValueError, match="budget_bytes must be a non-negative integer"):
        split_budget([t], -1)
    with pytest.raises(ValueError, match="distinct"):
        split_budget([t, t], 100)
    with pytest.raises(ValueError, match="same non-zero length"):
        TableCost("b", np.array([1, 2]), np.array([1.0]), 1)
    with pytest.raises(ValueError, match="row_cost must be a positive"):
        TableCost("b", np.array([1]), np.array([1.0]), 0)
