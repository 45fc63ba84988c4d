"""Miss-ratio curves against brute force: every point equals a direct simulation at that size, the LRU stack
distances give simulate_lru's misses at every size, and a SHARDS sample stays within 0.01 of the exact curve."""
import numpy as np
import pytest

from cachedemb.sizing import curves, shards, simulators
from cachedemb.sizing.curves import MissRatioCurve, WarmStart, miss_ratio_curve
from cachedemb.sizing.stack_distance import lru_misses, lru_stack_distances
from cachedemb.tools.traces import zipf_trace


def random_trace(rng, num_ids, num_batches, max_batch):
    return [rng.integers(0, num_ids, size=int(rng.integers(0, max_batch + 1))) for _ in range(num_batches)]


@pytest.fixture(scope="module")
def zipf():
    return zipf_trace(100_000, 2048, 60, 1.0, seed=3)


def test_lru_stack_distances_give_every_size():
    for seed in range(200):
        rng = np.random.default_rng(seed)
        trace = random_trace(rng, int(rng.integers(2, 30)), int(rng.integers(1, 15)), int(rng.integers(1, 12)))
        d = lru_stack_distances(trace)
        sizes = np.arange(1, 35)
        # the batch model's oversized batches (ties by id) included
        assert lru_misses(d, sizes).tolist() == [simulators.simulate_lru(trace, int(c)).misses for c in sizes]


def test_lru_stack_distance_is_the_rank_before_the_batch():
    # batch 0: ids 1, 2 (2 ranks above 1); batch 1: id 3; batch 2: 1 is below 3 and 2 -> rank 3
    d = lru_stack_distances([np.array([1, 2]), np.array([3]), np.array([1, 2, 3])])
    inf = simulators.INF
    assert d.tolist() == [inf, inf, inf, 3, 2, 1]


@pytest.mark.parametrize("policy", ["lru", "lfu", "opt", "lookahead"])
def test_curve_points_equal_direct_simulation(zipf, policy):
    curve = miss_ratio_curve(zipf, policy, points=12, horizon=8, depth=2)
    assert curve.sizes[0] == 0 and curve.rows_moved[0] == curve.unique_lookups
    assert curve.method == ("stack" if policy == "lru" else "simulation") and curve.stderr is None
    prep = simulators.prepare_trace(zipf)
    kw = {"horizon": 8, "depth": 2, "prefetch": True, "overlap": True} if policy == "lookahead" else {}
    for size, moved in zip(curve.sizes[1:], curve.rows_moved[1:]):
        r = simulators.simulate(policy, prep, int(size), **kw)
        assert moved == r.rows_moved, size
    assert curve.unique_lookups == prep.unique_lookups and curve.lookups == prep.lookups
    assert curve.distinct_ids == prep.num_ids if prep.values is not None else True
    assert curve.sizes[-1] == curve.distinct_ids  # the grid ends where every id fits
    np.testing.assert_allclose(curve.rows_per_batch, curve.rows_moved / len(zipf))


def test_warm_start_curve_equals_simulation_with_the_modules_preload(zipf):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=100_000)
    warm = WarmStart(counts, ratio=0.5)
    curve = miss_ratio_curve(zipf, "lfu", sizes=[0, 100, 1000, 5000], warm_start=warm, num_rows=100_000)
    for size, moved in zip(curve.sizes[1:], curve.rows_moved[1:]):
        k = int(0.5 * size)
        import torch

        preload = torch.topk(torch.from_numpy(counts), k, sorted=True).indices.sort().values.numpy()
        r = simulators.simulate_lfu(zipf, int(size), initial_counts=counts, preload=preload)
        assert moved == r.rows_moved
    lru = miss_ratio_curve(zipf, "lru", sizes=[0, 1000], warm_start=warm)
    assert lru.method == "simulation"  # preloaded rows break the stack pass: simulated per size


@pytest.fixture(scope="module")
def zipf_large():
    return zipf_trace(500_000, 8192, 40, 1.0, seed=3)


@pytest.mark.parametrize("policy", ["lru", "lfu", "opt", "lookahead"])
def test_shards_sample_within_001_of_exact(zipf_large, policy):
    """A quarter of the id space (~25k of 100k distinct ids) is kept; measured over salts 0-5 the largest error
    is 0.004-0.012 with the standard error estimate at 0.003-0.012 (docs/sizing.md)."""
    exact = miss_ratio_curve(zipf_large, policy, points=10, horizon=8, depth=1)
    sampled = miss_ratio_curve(zipf_large, policy, sizes=exact.sizes, sample_rate=0.25, horizon=8, depth=1)
    assert sampled.method.startswith("shards-") and sampled.sample_rate == pytest.approx(0.25, abs=1e-6)
    assert sampled.unique_lookups == exact.unique_lookups  # counted on the full trace
    error = np.abs(sampled.miss_ratio - exact.miss_ratio)
    assert error.max() < 0.01
    assert sampled.stderr is not None and sampled.stderr.shape == exact.sizes.shape and sampled.stderr[0] == 0
    assert error.max() < 3 * sampled.max_stderr + 0.002  # the reported error is of the right size
    assert abs(sampled.distinct_ids - exact.distinct_ids) < 0.05 * exact.distinct_ids


def test_regression_estimate_is_exact_where_every_use_misses_or_only_first_uses_do():
    """The two regimes a hot id breaks the plain estimators in: a 1-row cache (y = x for every id) and a cache
    holding everything (y = 1): the estimate is the exact trace's, whatever the sample holds."""
    trace = zipf_trace(20_000, 2000, 30, 1.2, seed=4)
    exact = miss_ratio_curve(trace, "lru", sizes=[1, 20_000])
    for salt in range(4):
        sampled = miss_ratio_curve(trace, "lru", sizes=[1, 20_000], sample_rate=0.2, salt=salt, error_bands=0)
        assert sampled.miss_ratio[0] == pytest.approx(exact.miss_ratio[0], abs=1e-3)  # 1 row: y = x
        assert sampled.miss_ratio[1] == pytest.approx(exact.miss_ratio[1], rel=0.1)  # first uses: ids counted


def test_sampling_keeps_every_access_of_a_kept_id():
    trace = [np.array([5, 5, 7, 9, 11]), np.array([5, 9, 13]), np.array([7, 7])]
    t = shards.table_trace(trace, rate=0.5, salt=3)
    kept = set(t.kept_ids().tolist())
    h = {i: int(shards.spatial_hash([i], 3)[0]) for i in (5, 7, 9, 11, 13)}
    assert kept == {i for i, v in h.items() if v < t.hi}
    for b, u, c in zip(trace, t.uniq, t.counts):
        ids, counts = np.unique(b, return_counts=True)
        keep = np.isin(ids, list(kept))
        assert u.tolist() == ids[keep].tolist() and c.tolist() == counts[keep].tolist()
    assert t.unique_per_batch.tolist() == [4, 3, 1] and t.lookups == 10


def test_adaptive_sample_equals_a_fixed_rate_from_the_start():
    trace = zipf_trace(50_000, 1000, 30, 0.9, seed=1)
    adaptive = shards.table_trace(trace, max_unique=5000)
    assert adaptive.kept_unique_lookups <= 5000 and not adaptive.exact
    fixed = shards.table_trace(trace, rate=adaptive.rate)
    assert fixed.hi == adaptive.hi
    for a, b in zip(adaptive.uniq, fixed.uniq):
        assert a.tolist() == b.tolist()
    small = shards.table_trace([np.array([1, 2, 3])] * 100, max_unique=5000)
    assert small.exact  # a table whose batches have few distinct ids stays exact


def test_bands_partition_the_sample():
    t = shards.table_trace(zipf_trace(20_000, 500, 10, 1.0, seed=2), rate=0.5)
    bands = t.split_bands(4)
    assert sum(b.hi - b.lo for b in bands) == t.hi - t.lo
    for j in range(t.num_batches):
        merged = np.sort(np.concatenate([b.uniq[j] for b in bands]))
        assert merged.tolist() == t.uniq[j].tolist()


def test_curve_interpolates_between_points_and_is_flat_past_the_end():
    c = MissRatioCurve("lfu", np.array([0, 10, 20]), np.array([100.0, 60.0, 40.0]), num_batches=4,
                       unique_lookups=100, lookups=150, distinct_ids=20)
    assert c.miss_ratio_at(15) == pytest.approx(0.5) and c.miss_ratio_at(1000) == pytest.approx(0.4)
    assert c.rows_per_batch_at(10) == pytest.approx(15.0)
    assert c.to_dict()["miss_ratio"] == [1.0, 0.6, 0.4]


def test_default_sizes():
    s = curves.default_sizes(1000, points=8)
    assert s[0] == 0 and s[1] == 1 and s[-1] == 1000 and np.all(np.diff(s) > 0)
    assert curves.default_sizes(1000, points=8, num_rows=300)[-1] == 300
    assert curves.default_sizes(0).tolist() == [0, 1]


def test_bad_arguments_raise():
    trace = [np.array([1, 2, 3])]
    with pytest.raises(ValueError, match="policy='fifo'"):
        miss_ratio_curve(trace, "fifo")
    with pytest.raises(ValueError, match="horizon must be a positive"):
        miss_ratio_curve(trace, "lookahead", horizon=0)
    with pytest.raises(ValueError, match="sample rate must be in"):
        miss_ratio_curve(trace, "lfu", sample_rate=0)
    with pytest.raises(ValueError, match="error_bands"):
        miss_ratio_curve(trace, "lfu", sample_rate=0.5, error_bands=1)
    with pytest.raises(ValueError, match="sizes must be"):
        miss_ratio_curve(trace, "lfu", sizes=[-1, 2])
    with pytest.raises(ValueError, match=r"id 3 is outside the table's \[0, 3\)"):
        miss_ratio_curve(trace, "lfu", num_rows=3)
    with pytest.raises(ValueError, match="warm-start counts"):
        WarmStart(np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="warmup ratio"):
        WarmStart(np.array([1, 2]), ratio=2)
