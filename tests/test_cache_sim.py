"""Cache-policy simulators against tiny pure-Python references of the same rules, plus traces."""

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from cachedemb.sizing import simulators as cache_sim
from cachedemb.tools import traces

INF = 1 << 62
MASK64 = (1 << 64) - 1


def random_trace(rng, num_ids, num_batches, max_batch):
    return [
        rng.integers(0, num_ids, size=int(rng.integers(0, max_batch + 1))).astype(np.int64)
        for _ in range(num_batches)
    ]


# ---------------------------------------------------------------- pure-Python references


def ref_full(trace, capacity, policy, horizon=1, depth=1, initial_counts=None, preload=(), prefetch=False,
             overlap=False):
    """One id at a time, with sets and dicts: the rules as the cache_sim docstrings state them."""
    batches = [Counter(int(x) for x in b) for b in trace]
    T = len(batches)
    cache, last, count, rcount = {int(i) for i in preload}, {}, Counter(), {}
    window_end, pending = 0, None
    if initial_counts is not None:
        count.update({i: int(c) for i, c in enumerate(initial_counts)})
    moved, hits, streamed = [], 0, 0
    for t in range(T):
        U = set(batches[t])
        hits += len(U & cache)
        for i, c in batches[t].items():
            rcount[i] = rcount.get(i, 0) + c if i in cache else c
            last[i] = t
            count[i] += c
        P = set(U)
        if policy == "lookahead" and prefetch:  # cachedemb.prefetch's windows
            if t >= window_end:
                remaining = T - t
                if pending is not None and pending[0] == t:
                    k, union = pending[1], pending[2]
                else:
                    k = min(depth, remaining)
                    while k >= 1 and len(set().union(*batches[t:t + k])) > capacity:
                        k //= 2
                    union = set().union(*batches[t:t + k]) if k else None
                pending, window_end = None, t + max(k, 1)
                if k:
                    P = set(union)
                    nxt = min(depth, min(horizon, remaining) - k)
                    ahead = set().union(*batches[window_end:window_end + nxt]) if nxt >= 1 else set()
                    if overlap and nxt >= 1 and len(P | ahead) <= capacity:
                        pending, P = (window_end, nxt, ahead), P | ahead
        elif policy == "lookahead":
            for j in range(1, depth):
                if t + j >= T or len(P | set(batches[t + j])) > capacity:
                    break
                P |= set(batches[t + j])

        def next_use(i):
            return next((s for s in range(t + 1, T) if i in batches[s]), INF)

        def key(i):
            if policy == "lru":
                return (last.get(i, -1), i)
            if policy == "lfu":
                return (count[i], last.get(i, -1), i)
            if policy == "lfu_reset":
                return (rcount.get(i, 0), last.get(i, -1), i)
            if policy == "opt":
                return (-next_use(i), i)
            nu = next_use(i)
            warm = nu < t + horizon
            return (int(warm), -nu if warm else 0, count[i], last.get(i, -1), i)

        moved.append(len(P - cache))
        if len(P) <= capacity:
            while len(cache | P) > capacity:
                cache.remove(min(cache - P, key=key))
            cache |= P
        else:
            kept = set(sorted(U, key=key)[len(U) - capacity:])
            streamed += len(U - cache - kept)
            cache = kept
    return moved, hits, streamed


def ref_fmix64(i):
    h = i & MASK64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK64
    h ^= h >> 33
    return h


def ref_set_lru(trace, capacity, ways):
    ways = min(ways, capacity)
    num_sets = capacity // ways
    sets = [set() for _ in range(num_sets)]
    last = {}
    moved, hits, streamed = [], 0, 0
    for t, b in enumerate(trace):
        U = {int(x) for x in b}
        by_set = {}
        for i in U:
            by_set.setdefault(ref_fmix64(i) % num_sets, set()).add(i)
        miss = 0
        for s, Us in by_set.items():
            cache = sets[s]
            hits += len(Us & cache)
            miss += len(Us - cache)
            for i in Us:
                last[i] = t
            if len(Us) <= ways:
                while len(cache | Us) > ways:
                    cache.remove(min(cache - Us, key=lambda i: (last[i], i)))
                cache |= Us
            else:
                kept = set(sorted(Us, key=lambda i: (last[i], i))[len(Us) - ways:])
                streamed += len(Us - cache - kept)
                sets[s] = kept
        moved.append(miss)
    return moved, hits, streamed


def exhaustive_optimum(trace, capacity):
    """Fewest rows moved over every demand schedule of the cache model (tiny traces only)."""
    states = {frozenset(): 0}
    for b in trace:
        U = frozenset(int(x) for x in b)
        nxt = {}
        for S, cost in states.items():
            c = cost + len(U - S)
            if len(U) <= capacity:
                others = sorted(S - U)
                options = (
                    U | frozenset(keep)
                    for r in range(min(len(others), capacity - len(U)) + 1)
                    for keep in itertools.combinations(others, r)
                )
            else:
                options = (frozenset(k) for k in itertools.combinations(sorted(U), capacity))
            for S2 in options:
                if c < nxt.get(S2, INF):
                    nxt[S2] = c
        states = nxt
    return min(states.values())


def check(result, ref):
    moved, hits, streamed = ref
    assert result.rows_moved_per_batch.tolist() == moved
    assert result.rows_moved == sum(moved)
    assert result.hits == hits
    assert result.streamed == streamed


SIMS = {
    "lru": cache_sim.simulate_lru,
    "lfu": cache_sim.simulate_lfu,
    "lfu_reset": cache_sim.simulate_lfu_reset,
    "opt": cache_sim.simulate_opt,
}

# ---------------------------------------------------------------- simulators vs references


@pytest.mark.parametrize("policy", sorted(SIMS))
def test_full_policies_match_reference(policy):
    for seed in range(150):
        rng = np.random.default_rng(seed)
        num_ids = int(rng.integers(3, 25))
        trace = random_trace(rng, num_ids, int(rng.integers(1, 14)), int(rng.integers(1, 10)))
        prep = cache_sim.prepare_trace(trace)
        for cap in (1, 2, 3, 5, 8, 13):
            r = SIMS[policy](prep, cap)
            check(r, ref_full(trace, cap, policy))
            assert r.misses == r.unique_lookups - r.hits == r.rows_moved
            assert r.lookups == sum(b.size for b in trace)


def test_lookahead_matches_reference():
    for seed in range(150):
        rng = np.random.default_rng(100 + seed)
        trace = random_trace(rng, int(rng.integers(3, 25)), int(rng.integers(1, 14)), int(rng.integers(1, 9)))
        prep = cache_sim.prepare_trace(trace)
        for cap, horizon, depth in itertools.product((1, 3, 6, 12), (1, 2, 5), (1, 2, 3)):
            r = cache_sim.simulate_lookahead(prep, cap, horizon=horizon, depth=depth)
            check(r, ref_full(trace, cap, "lookahead", horizon, depth))
            assert r.misses == r.unique_lookups - r.hits
            assert r.misses <= r.rows_moved


def test_prefetch_windows_match_reference():
    """cachedemb.prefetch's windows: halved until they fit, kept until they end, the next one admitted early
    with overlap when both fit and the horizon has read it."""
    for seed in range(120):
        rng = np.random.default_rng(700 + seed)
        trace = random_trace(rng, int(rng.integers(3, 25)), int(rng.integers(1, 16)), int(rng.integers(1, 9)))
        prep = cache_sim.prepare_trace(trace)
        for cap, (horizon, depth), overlap in itertools.product((1, 3, 6, 12), ((1, 1), (2, 2), (4, 2), (8, 4)),
                                                                (False, True)):
            r = cache_sim.simulate_lookahead(prep, cap, horizon=horizon, depth=depth, prefetch=True, overlap=overlap)
            check(r, ref_full(trace, cap, "lookahead", horizon, depth, prefetch=True, overlap=overlap))
            if depth == 1 and not overlap:
                slide = cache_sim.simulate_lookahead(prep, cap, horizon=horizon, depth=1)
                assert slide.rows_moved_per_batch.tolist() == r.rows_moved_per_batch.tolist()


def test_warm_start_matches_reference():
    """Preloaded rows and seeded counts (the module's id_freq + warmup_ratio), ids compacted or not."""
    for seed in range(80):
        rng = np.random.default_rng(500 + seed)
        num_ids = int(rng.integers(3, 25))
        trace = random_trace(rng, num_ids, int(rng.integers(1, 12)), int(rng.integers(1, 8)))
        counts = rng.integers(0, 6, size=num_ids + 3)
        for cap in (1, 3, 6, 12):
            preload = rng.choice(num_ids + 3, size=min(cap, num_ids + 3, int(rng.integers(0, cap + 1))), replace=False)
            for shift in (0, 1 << 40):  # ids past the direct-index bound are compacted
                shifted = [b + shift for b in trace]
                big_counts = counts if not shift else None
                for policy in ("lru", "lfu", "lfu_reset", "opt"):
                    kw = {"initial_counts": big_counts} if policy == "lfu" else {}
                    r = cache_sim.simulate(policy, shifted, cap, preload=preload + shift, **kw)
                    ref = ref_full(trace, cap, policy, initial_counts=big_counts if policy == "lfu" else None,
                                   preload=preload)
                    check(r, ref)
                r = cache_sim.simulate_lookahead(shifted, cap, horizon=2, depth=2, initial_counts=big_counts,
                                                 preload=preload + shift)
                check(r, ref_full(trace, cap, "lookahead", 2, 2, initial_counts=big_counts, preload=preload))


def test_warm_start_errors():
    with pytest.raises(ValueError, match="more than the capacity"):
        cache_sim.simulate_lfu([np.array([1, 2])], 2, preload=[3, 4, 5])
    with pytest.raises(ValueError, match="initial_counts must be a 1-D integer"):
        cache_sim.simulate_lfu([np.array([1, 2])], 2, initial_counts=np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="non-negative"):
        cache_sim.simulate_lfu([np.array([1, 2])], 2, initial_counts=np.array([0, -1, 0]))
    prep = cache_sim.prepare_trace([np.array([1 << 40])])
    with pytest.raises(ValueError, match="neither in the trace"):
        cache_sim.simulate_lru(prep, 2, preload=[7])


def test_set_lru_matches_reference():
    for seed in range(150):
        rng = np.random.default_rng(200 + seed)
        trace = random_trace(rng, int(rng.integers(3, 40)), int(rng.integers(1, 14)), int(rng.integers(1, 12)))
        for cap, ways in ((1, 32), (5, 32), (4, 2), (7, 2), (9, 3), (16, 4), (64, 32)):
            check(cache_sim.simulate_set_lru(trace, cap, ways=ways), ref_set_lru(trace, cap, ways))


def test_set_lru_with_one_set_is_lru():
    for seed in range(20):
        rng = np.random.default_rng(300 + seed)
        trace = random_trace(rng, 30, 12, 10)
        for cap in (1, 4, 9, 32):
            a, b = cache_sim.simulate_set_lru(trace, cap), cache_sim.simulate_lru(trace, cap)
            assert a.rows_moved_per_batch.tolist() == b.rows_moved_per_batch.tolist()
            assert (a.hits, a.streamed) == (b.hits, b.streamed)


def test_fmix64_matches_reference_and_wraps():
    ids = np.array([0, 1, 2, 12345, 2**40 + 7, 2**63 - 1, -1, -(2**63)], dtype=np.int64)
    assert cache_sim.murmur3_fmix64(ids).tolist() == [ref_fmix64(int(i)) for i in ids]
    h = cache_sim.murmur3_fmix64(np.arange(100000))
    assert np.unique(h).size == 100000  # a bijection on 64 bits


# ---------------------------------------------------------------- optimality


def test_old_module_name_serves_the_same_simulators():
    from cachedemb.tools import cache_sim as old

    assert old.simulate_lfu is cache_sim.simulate_lfu and set(old.__all__) == set(cache_sim.__all__)


def test_opt_equals_exhaustive_optimum():
    for seed in range(150):
        rng = np.random.default_rng(400 + seed)
        trace = random_trace(rng, 6, int(rng.integers(1, 8)), 5)
        for cap in (1, 2, 3):
            assert cache_sim.simulate_opt(trace, cap).rows_moved == exhaustive_optimum(trace, cap)


def test_opt_moves_fewest_rows():
    for seed in range(80):
        rng = np.random.default_rng(500 + seed)
        trace = random_trace(rng, int(rng.integers(5, 60)), 20, int(rng.integers(2, 20)))
        prep = cache_sim.prepare_trace(trace)
        for cap in (1, 3, 8, 20, 40, 64, 96):
            opt = cache_sim.simulate_opt(prep, cap).rows_moved
            others = [SIMS[p](prep, cap) for p in ("lru", "lfu", "lfu_reset")]
            others += [cache_sim.simulate_lookahead(prep, cap, h, k) for h in (1, 4, 50) for k in (1, 3)]
            for r in others:
                assert opt <= r.rows_moved, (r.policy, cap)
            sa = cache_sim.simulate_set_lru(prep, cap)
            # A set that overflows while the batch fits streams rows (bypass), outside OPT's model.
            if cap < 64 or sa.streamed == 0:
                assert opt <= sa.rows_moved


def test_lookahead_with_full_horizon_is_opt():
    for seed in range(80):
        rng = np.random.default_rng(600 + seed)
        trace = random_trace(rng, int(rng.integers(5, 50)), 25, 8)
        prep = cache_sim.prepare_trace(trace)
        for cap in (8, 12, 20, 35):
            la = cache_sim.simulate_lookahead(prep, cap, horizon=len(trace), depth=1)
            assert la.rows_moved == cache_sim.simulate_opt(prep, cap).rows_moved


# ---------------------------------------------------------------- determinism and edge cases


def test_lru_ties_evict_lower_id():
    # 1 and 2 were used in the same batch: LRU evicts id 1, so the last batch [2] hits, [1] misses.
    r = cache_sim.simulate_lru([np.array([2, 1]), np.array([3]), np.array([2]), np.array([1])], 2)
    assert r.rows_moved_per_batch.tolist() == [2, 1, 0, 1]


def test_lfu_ties_by_last_use_then_id():
    # counts: 5->2, 6->1, 7->1 (7 used later than 6): 6 goes first.
    tr = [np.array([5, 5, 6]), np.array([7]), np.array([8]), np.array([7, 5])]
    assert cache_sim.simulate_lfu(tr, 3).rows_moved_per_batch.tolist() == [2, 1, 1, 0]
    # 6 and 7 equal in count and last use: the lower id (6) goes first.
    tr = [np.array([5, 5, 6, 7]), np.array([8]), np.array([7, 5])]
    assert cache_sim.simulate_lfu(tr, 3).rows_moved_per_batch.tolist() == [3, 1, 0]


def test_lfu_reset_forgets_counts_on_eviction():
    # Hot id 1 is evicted by batch [2, 3] (both protected), then re-admitted by batch [1].
    # Persistent counts keep 1 (6) over 2 (3) when 4 arrives; reset counts evict 1 (count 1).
    tr = [np.array([1] * 5), np.array([2, 2]), np.array([2, 3]), np.array([1]), np.array([4]), np.array([1])]
    assert cache_sim.simulate_lfu(tr, 2).rows_moved_per_batch.tolist() == [1, 1, 1, 1, 1, 0]
    assert cache_sim.simulate_lfu_reset(tr, 2).rows_moved_per_batch.tolist() == [1, 1, 1, 1, 1, 1]


def test_results_do_not_depend_on_order_within_batch_or_id_representation():
    rng = np.random.default_rng(7)
    trace = random_trace(rng, 40, 15, 12)
    shuffled = [rng.permutation(b) for b in trace]
    sparse = [b * 1_000_003 + 10**12 for b in trace]  # same order, far-apart ids: compacted path
    for name in ("lru", "lfu", "lfu_reset", "opt"):
        a = SIMS[name](trace, 7)
        for other in (shuffled, sparse):
            b = SIMS[name](other, 7)
            assert a.rows_moved_per_batch.tolist() == b.rows_moved_per_batch.tolist()
    assert cache_sim.prepare_trace(sparse).values is not None


def test_oversized_batch_counts_every_miss_and_streams_excess():
    r = cache_sim.simulate_lru([np.arange(10), np.arange(10)], 4)
    assert r.rows_moved_per_batch.tolist() == [10, 6]  # ids 6..9 (largest, equally recent) kept
    assert (r.streamed, r.hits, r.misses) == (6 + 6, 4, 16)
    assert r.hit_rate == pytest.approx(4 / 20)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="capacity"):
        cache_sim.simulate_lru([np.array([1])], 0)
    with pytest.raises(ValueError, match="horizon"):
        cache_sim.simulate_lookahead([np.array([1])], 2, horizon=0)
    with pytest.raises(ValueError, match="batch 1.*integer"):
        cache_sim.simulate_lru([np.array([1]), np.array([1.5])], 2)
    with pytest.raises(ValueError, match="unknown policy"):
        cache_sim.simulate("fifo", [np.array([1])], 2)
    assert cache_sim.simulate("lookahead", [np.array([1])], 2, horizon=3).rows_moved == 1


def test_empty_trace_and_batches():
    assert cache_sim.simulate_opt([], 3).rows_moved == 0
    r = cache_sim.simulate_set_lru([np.array([], dtype=np.int64), np.array([3, 3])], 3)
    assert r.rows_moved_per_batch.tolist() == [0, 1] and r.hit_rate == 0.0


# ---------------------------------------------------------------- traces


def test_load_trace_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    ragged = [rng.integers(0, 100, size=n) for n in (3, 0, 7, 1)]
    traces.save_trace(tmp_path / "t.npz", ragged)
    assert [b.tolist() for b in traces.load_trace(tmp_path / "t.npz")] == [b.tolist() for b in ragged]
    square = [rng.integers(0, 100, size=5) for _ in range(4)]
    for name in ("t.npy", "t.txt"):
        traces.save_trace(tmp_path / name, square)
        loaded = traces.load_trace(tmp_path / name)
        assert [b.tolist() for b in loaded] == [b.tolist() for b in square]
        assert all(b.dtype == np.int64 for b in loaded)
    (tmp_path / "c.csv").write_text("# recorded\n1, 2,3\n\n4 5\t6,7\n")
    assert [b.tolist() for b in traces.load_trace(tmp_path / "c.csv")] == [[1, 2, 3], [4, 5, 6, 7]]


def test_load_trace_errors(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_text("1 2 3\n4 x5 6\n")
    with pytest.raises(ValueError, match=r"bad\.txt:2: .*'x5'"):
        traces.load_trace(p)
    p.write_text("1 2\n3 -4\n")
    with pytest.raises(ValueError, match=r"bad\.txt:2: .*non-negative"):
        traces.load_trace(p)
    np.save(tmp_path / "flat.npy", np.arange(5))
    with pytest.raises(ValueError, match=r"flat\.npy.*2-D"):
        traces.load_trace(tmp_path / "flat.npy")
    np.save(tmp_path / "float.npy", np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"float\.npy.*integer"):
        traces.load_trace(tmp_path / "float.npy")
    np.savez(tmp_path / "nooff.npz", ids=np.arange(4))
    with pytest.raises(ValueError, match=r"nooff\.npz.*batch_offsets"):
        traces.load_trace(tmp_path / "nooff.npz")
    np.savez(tmp_path / "off.npz", ids=np.arange(4), batch_offsets=np.array([0, 3, 2, 4]))
    with pytest.raises(ValueError, match=r"off\.npz.*non-decreasing"):
        traces.load_trace(tmp_path / "off.npz")
    with pytest.raises(ValueError, match="empty batches"):
        traces.save_trace(tmp_path / "e.txt", [np.array([1]), np.array([], dtype=np.int64)])


@pytest.mark.parametrize("alpha", [0.7, 1.0, 1.2])
def test_zipf_follows_power_law(alpha):
    tr = traces.zipf_trace(1000, 50_000, 8, alpha, seed=1, permute=False)
    counts = np.bincount(np.concatenate(tr), minlength=1000)
    assert math.log10(counts[0] / counts[9]) == pytest.approx(alpha, abs=0.08)


def test_zipf_permutes_ids_reproducibly():
    a = traces.zipf_trace(5000, 20_000, 2, 1.1, seed=3)
    b = traces.zipf_trace(5000, 20_000, 2, 1.1, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    ids = np.concatenate(a)
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 5000
    hottest = np.argsort(np.bincount(ids, minlength=5000))[::-1][:5]
    assert set(hottest.tolist()) != set(range(5))  # hot ids are scattered
    perm = traces._RandomBijection(5000, np.random.default_rng(0))(np.arange(5000))
    assert np.array_equal(np.sort(perm), np.arange(5000))


def test_zipf_tail_approximation_is_accurate():
    n, head = 200_000, 1000
    for alpha in (0.6, 1.0, 1.3):
        s = traces._ZipfSampler(n, alpha, head=head)
        exact = np.sum(np.arange(1, n + 1, dtype=np.float64) ** -alpha)
        assert s.head_mass + s.tail_mass == pytest.approx(exact, rel=1e-6)
        ranks = s.sample(np.random.default_rng(0), 200_000)
        assert ranks.min() >= 0 and ranks.max() < n
        # share of draws beyond the head matches the exact tail mass
        tail_exact = np.sum(np.arange(head + 1, n + 1, dtype=np.float64) ** -alpha) / exact
        assert np.mean(ranks >= head) == pytest.approx(tail_exact, abs=0.005)
    big = traces.zipf_trace(20_000_000, 10_000, 1, 0.9, seed=0)[0]
    assert big.min() >= 0 and big.max() < 20_000_000


def test_criteo_like_trace_layout():
    sizes = traces.criteo_table_sizes(1e-3)
    assert len(sizes) == 26 and sizes[2] == 10132 and sizes[8] == 1
    tr = traces.criteo_like_trace(None, batch_size=64, num_batches=3, seed=0, scale=1e-3)
    assert len(tr) == 3 and all(b.shape == (64 * 26,) for b in tr)
    offs = traces.table_offsets(sizes)
    per_table = np.stack(tr).reshape(-1, 26)
    assert np.all(per_table >= offs) and np.all(per_table < offs + np.array(sizes))
    tr2 = traces.criteo_like_trace([10, 1000], batch_size=500, num_batches=2, alphas=[0.0, 1.2], seed=0)
    ids = np.stack(tr2).reshape(-1, 2)
    assert np.unique(ids[:, 0]).size == 10 and ids[:, 1].min() >= 10
    with pytest.raises(ValueError, match="one per table"):
        traces.criteo_like_trace([10, 20], alphas=[1.0])
