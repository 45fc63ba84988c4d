"""The victim pool (cachedemb/cache/victim_pool.py) against a brute-force full ranking: over random sequences of hits,
admissions and invalidating events, its first n_admit victims equal the n_admit lowest scores of every slot
(Python's sorted over the policy's full-view scores). Both sizing rules (host branch / device flag) and both
backends; then whole modules: the pool's evictions equal a full ranking's per batch."""
import random

import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.kernels import PROTECTED, victim_select_torch
from cachedemb.cache.policy import POLICIES, SlotView
from cachedemb.cache import pool_native
from cachedemb.cache.victim_pool import VictimPool
from conftest import skip_triton_on_cpu_without_interpreter

@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    skip_triton_on_cpu_without_interpreter(request.param)
    monkeypatch.setenv("CACHEDEMB_BACKEND", request.param)
    return request.param


class Slots:
    """Per-slot metadata of a cache of C slots, changed the ways a cache changes it."""

    def __init__(self, capacity: int, g: random.Random):
        self.C, self.g = capacity, g
        self.ids = torch.tensor([g.randrange(-1, 1000) if g.random() < 0.2 else g.randrange(1000)
                                 for _ in range(capacity)], dtype=torch.int64)
        self.freq = torch.tensor([g.randrange(20) for _ in range(capacity)], dtype=torch.int64)
        self.last = torch.tensor([g.randrange(5) for _ in range(capacity)], dtype=torch.int64)
        self.next = torch.tensor([g.choice([-1, -1, g.randrange(64)]) for _ in range(capacity)], dtype=torch.int64)
        self.window = torch.zeros(capacity, dtype=torch.bool)

    def view(self, slots, protected):
        if slots is None:
            return SlotView(self.ids, self.freq, self.last, self.next, protected)
        return SlotView(self.ids[slots], self.freq[slots], self.last[slots], self.next[slots], protected,
                        None, slots, self.C)


def at(protected):
    return lambda which: protected if which is None else protected[which]


def unprotect(policy, slots: Slots, protected):
    """The cache's contract, the long way: scores of the batch's hit slots as if only the window protected."""
    def apply(score):
        window_only = policy(slots.view(None, slots.window))
        score.copy_(torch.where(protected & ~slots.window, window_only, score))
    return apply


def brute_force(policy, slots: Slots, protected, n: int) -> list[int]:
    score = policy(slots.view(None, protected)).tolist()
    order = sorted(range(slots.C), key=lambda s: score[s])
    return [s for s in order if score[s] < PROTECTED][:n]


def c_rescore(slots: Slots, protected):
    """VictimPool.choose's `rescore` over `slots` under `protected`, as EmbeddingCache._rescore_pool gives it."""
    def rescore(policy, pool, joined, bound, mark, scratch, drop_protected=False):
        return pool_native.rescore(pool_native.kind(policy), pool, joined, slots.C, slots.ids, slots.freq,
                                   slots.last, slots.next, protected, bound, mark, scratch, drop_protected)
    return rescore


@pytest.mark.parametrize("policy_name", ["lfu", "lru", "lookahead"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rescore", ["steps", "c"])
@pytest.mark.parametrize("placement", ["batch", "window"])
def test_pool_victims_equal_the_full_ranking(policy_name, seed, rescore, placement, sizing_mode, backend):
    """Also when a window's protection comes off (its slots join the pool, their next uses moved on): the joined
    slots are merged at the next choice, one by one or in the C re-scoring pass. `window`: every choice places a
    prefetch window, whose hits and admitted slots stay protected until the window's protection comes off, so
    the pool drops its protected candidates (`drop_protected`)."""
    if placement == "window" and (sizing_mode != "exact" or backend == "triton"):
        pytest.skip("protected candidates are dropped on the exact path (counts on the host) only")
    if rescore == "c" and (sizing_mode != "exact" or backend == "triton"):
        pytest.skip("the C re-scoring serves the exact path on CPU (no kernel of its own)")
    if rescore == "c" and pool_native.union(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 1,
                                            torch.zeros(1, dtype=torch.bool)) is None:
        pytest.skip("C helpers off")
    g = random.Random(seed)
    policy = POLICIES[policy_name]
    C = 97
    slots = Slots(C, g)
    pool = VictimPool(C, "cpu", batches=3)
    exact = sizing_mode == "exact"
    if backend == "triton" and seed:
        pytest.skip("the interpreter is slow: one seed for the kernels, both for the reference")
    steps = 30 if backend == "torch" else (8 if exact else 5)
    for step in range(1, steps + 1):
        event = g.random()
        if event < 0.1:  # halving, new next uses or dropped protection: the cache invalidates
            slots.freq >>= 1
            slots.next = torch.tensor([g.choice([-1, g.randrange(64)]) for _ in range(C)], dtype=torch.int64)
            slots.window.zero_()
            pool.invalidate()
        elif event < 0.2:  # protection only added: no invalidation needed
            slots.window[torch.tensor(g.sample(range(C), 5))] = True
        elif event < 0.35 and slots.window.any():  # a window's protection off, its rows' next uses moved on
            joined = slots.window.nonzero().squeeze(1)
            slots.window.zero_()
            slots.next[joined] = torch.tensor([g.choice([-1, g.randrange(64)]) for _ in range(joined.numel())])
            # host locations and repeats, as windows give them
            pool.include(torch.cat([joined, joined[:2], torch.tensor([-5, C])]), exact)
        hit = torch.tensor(g.sample(range(C), g.randrange(0, 8)), dtype=torch.int64)
        protected = slots.window.clone()
        protected[hit] = True
        n_miss = g.randrange(1, 9)
        n_admit = min(n_miss, int((~protected).sum()))
        k = n_miss if exact else 12  # sync-free: the static bound
        n_hit = hit.numel() if exact else 12
        rankings = pool.rankings
        victims = pool.choose(policy, slots.view, unprotect(policy, slots, protected), at(protected), k,
                              torch.tensor([n_admit]), n_hit, exact,
                              rescore=c_rescore(slots, protected) if rescore == "c" else None,
                              drop_protected=placement == "window")
        assert victims.numel() >= n_admit
        assert victims[:n_admit].tolist() == brute_force(policy, slots, protected, n_admit), step
        if placement == "window" and pool.rankings == rankings and pool.slots.numel() < C:
            assert not bool(protected[pool.slots].any()), step  # the re-scored pool kept no protected candidate
        # Hits raise counts / last use; admitted rows take new ids and any count (the victims are pool slots).
        slots.freq[hit] += torch.tensor([g.randrange(1, 4) for _ in range(hit.numel())], dtype=torch.int64)
        slots.last[hit] = step + 5
        used = victims[:n_admit]
        slots.ids[used] = torch.tensor([1000 + g.randrange(10**6) for _ in range(n_admit)], dtype=torch.int64)
        slots.freq[used] = torch.tensor([g.randrange(30) for _ in range(n_admit)], dtype=torch.int64)
        slots.last[used] = step + 5
        if placement == "window":  # the window's slots stay protected until its protection comes off
            slots.window[hit] = True
            slots.window[used] = True
    if exact:  # the pool did the work for most batches: a full ranking only when it ran dry or was invalidated
        assert pool.rankings < steps // 2


def test_pool_is_not_used_for_a_policy_not_marked_monotone(sizing_mode):
    g = random.Random(3)
    slots = Slots(50, g)
    pool = VictimPool(50, "cpu", batches=4)

    def custom(view):  # not marked @monotone: the cache cannot know its scores never drop
        return POLICIES["lfu"](view)

    for _ in range(5):
        protected = torch.zeros(50, dtype=torch.bool)
        pool.choose(custom, slots.view, unprotect(custom, slots, protected), at(protected), 3, torch.tensor([3]), 0,
                    sizing_mode == "exact")
    assert pool.rankings == 5


def test_pool_rejects_negative_depth():
    with pytest.raises(ValueError, match="-1"):
        VictimPool(10, "cpu", batches=-1)


def run_module(policy, trace, capacity, halflife=None):
    emb = cachedemb.CachedEmbeddingBag(400, 4, mode="sum", cache_rows=capacity, optimizer=optim.SGD(lr=0.1),
                                       device="cpu", policy=policy, freq_halflife=halflife,
                                       _weight=torch.randn(400, 4, generator=torch.Generator().manual_seed(0)))
    resident = []
    for ids in trace:
        emb(ids, torch.tensor([0])).sum().backward()
        resident.append(emb.cache.slot_ids[:capacity].clone())
    return emb, resident


@pytest.mark.parametrize("policy_name", ["lfu", "lru"])
def test_module_evicts_as_a_full_ranking_does(policy_name, sizing_mode):
    """A module with the pool and one whose policy is unmarked (so every batch ranks all slots) keep the same
    rows in the same slots after every batch, and train the same table."""
    g = torch.Generator().manual_seed(7)
    # Zipf-ish ids: a hot head that stays resident, a long tail that keeps evicting.
    trace = [torch.cat([torch.randint(0, 20, (12,), generator=g), torch.randint(0, 400, (20,), generator=g)])
             for _ in range(40)]
    policy = POLICIES[policy_name]

    def unmarked(view):
        return policy(view)

    pooled, pooled_resident = run_module(policy_name, trace, 48, halflife=15)
    ranked, ranked_resident = run_module(unmarked, trace, 48, halflife=15)
    for t, (a, b) in enumerate(zip(pooled_resident, ranked_resident)):
        assert torch.equal(a, b), f"batch {t}: slots differ"
    assert torch.equal(pooled.cache.stats, ranked.cache.stats)
    pooled.cache.flush()
    ranked.cache.flush()
    assert torch.equal(pooled.cache.host_weight, ranked.cache.host_weight)
    assert ranked.cache.victim_pool.rankings > pooled.cache.victim_pool.rankings or sizing_mode == "sync_free"
    assert pooled.cache.timing_dict()["eviction"] > 0


@pytest.mark.parametrize("order", ["random", "ascending", "descending", "clustered"])
@pytest.mark.parametrize("k", [777, 30_000])
def test_threshold_cut_selects_the_k_smallest(order, k):
    """The CPU reference's sampled-threshold cut (host sizes) returns what a full sort does, whatever the
    layout of the scores (a sample can misjudge sorted or clustered scores: then it falls back)."""
    n = 140_003
    g = torch.Generator().manual_seed(k)
    base = torch.randperm(n, generator=g) * 3 - n
    score = {"random": base, "ascending": torch.sort(base).values, "descending": torch.sort(base).values.flip(0),
             "clustered": torch.where(torch.arange(n) % 4096 == 0, base - 10 * n, base)}[order]
    expected = torch.sort(score).indices[:k]
    assert torch.equal(victim_select_torch(score, k, host_sizes=True), expected)
    assert torch.equal(victim_select_torch(score, k), expected)


def test_gated_rankings_do_their_work_only_when_the_pool_runs_dry(monkeypatch):
    """Triton backend under the CUDA rules: the full ranking is launched every batch with the pool's `drained`
    flag as its gate; it does its work (`ranked`, a device count) only on the batches that need it, and the
    module keeps the same rows in the same slots as a full ranking of every slot each batch (an unmarked
    policy, run on the torch reference)."""
    skip_triton_on_cpu_without_interpreter("triton")
    g = torch.Generator().manual_seed(11)
    trace = [torch.cat([torch.randint(0, 30, (4,), generator=g), torch.randint(0, 2000, (8,), generator=g)])
             for _ in range(14)]
    lfu = POLICIES["lfu"]

    def unmarked(view):
        return lfu(view)

    def run(policy, backend, sync_free):
        monkeypatch.setenv("CACHEDEMB_BACKEND", backend)
        monkeypatch.setenv("CACHEDEMB_SYNC_FREE", sync_free)
        emb = cachedemb.CachedEmbeddingBag(2000, 4, mode="sum", cache_rows=300, optimizer=optim.SGD(lr=0.1),
                                           device="cpu", policy=policy,
                                           _weight=torch.randn(2000, 4, generator=torch.Generator().manual_seed(0)))
        resident = []
        for ids in trace:
            emb(ids, torch.tensor([0])).sum().backward()
            resident.append(emb.cache.slot_ids[:300].clone())
        emb.cache.flush()
        return emb, resident

    pooled, pooled_resident = run("lfu", "triton", "1")
    ranked, ranked_resident = run(unmarked, "torch", "0")
    for t, (a, b) in enumerate(zip(pooled_resident, ranked_resident)):
        assert torch.equal(a, b), f"batch {t}: slots differ"
    pool = pooled.cache.victim_pool
    assert pool.slots.numel() < 300  # a pool smaller than the cache (12 lookups: 12 + 12 + 8 x 12 slots)
    assert pool.rankings == len(trace)  # launched every batch (no host read of the flag) ...
    assert 1 <= int(pool.ranked) <= 3  # ... and run only when the pool ran dry (here: the first batch, one drain)
    assert int(ranked.cache.victim_pool.ranked) == ranked.cache.victim_pool.rankings == len(trace)
    torch.testing.assert_close(pooled.cache.host_weight, ranked.cache.host_weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy_name", ["lfu", "lookahead"])
def test_sync_free_pool_sized_by_misses_that_reached_the_host(policy_name, backend, monkeypatch):
    """Under the CUDA rules the static bound is a batch's lookups (64 here) while it misses a few rows: once miss
    counts reach the host (two batches late) the pool shrinks to ~10 batches of the recent misses, and a burst
    admitting more than the pool serves per batch takes the gated full ranking: every batch's victims still
    equal the brute-force n_admit lowest."""
    g = random.Random(5)
    policy = POLICIES[policy_name]
    C = 600
    slots = Slots(C, g)
    pool = VictimPool(C, "cpu")
    steps = 24 if backend == "torch" else 8
    bursts = {5, steps - 2}
    sizes = []
    for step in range(1, steps + 1):
        hit = torch.tensor(g.sample(range(C), g.randrange(0, 6)), dtype=torch.int64)
        protected = slots.window.clone()
        protected[hit] = True
        # batches of other shapes: the static bound may fall below what the pool serves a batch
        k = 64 if step in bursts or step < 6 else g.choice([64, 64, 10])
        n_miss = 40 if step in bursts else g.randrange(1, 7)
        n_admit = min(n_miss, int((~protected).sum()))
        victims = pool.choose(policy, slots.view, unprotect(policy, slots, protected), at(protected), k,
                              torch.tensor([n_admit]), k, False)
        pool.observe(torch.tensor([n_miss]))
        assert victims.numel() == k and bool(((victims >= 0) & (victims < C)).all())
        assert victims[:n_admit].tolist() == brute_force(policy, slots, protected, n_admit), step
        sizes.append(pool.slots.numel())
        slots.freq[hit] += 1
        slots.last[hit] = step + 5
        used = victims[:n_admit]
        slots.ids[used] = torch.tensor([1000 + g.randrange(10**6) for _ in range(n_admit)], dtype=torch.int64)
        slots.freq[used] = torch.tensor([g.randrange(30) for _ in range(n_admit)], dtype=torch.int64)
        slots.last[used] = step + 5
    assert sizes[0] == C  # no count on the host yet: the static bound's pool (10 x 64 > C)
    assert min(sizes) <= 10 * 16  # then ~10 batches of the misses seen (6 -> 16 a batch)
    assert int(pool.ranked) < steps  # most batches served by the pool, bursts included via the gate
    assert pool.rankings - int(pool.ranked) >= steps // 2  # gated launches that did no work


def test_miss_estimate_sees_counts_only_after_they_land():
    """On CPU a count stands in for a GPU copy that lands `lag` batches later; the estimate is the largest
    recent one, and a window forgets old bursts."""
    from cachedemb.cache.miss_estimate import MissEstimate

    est = MissEstimate(torch.device("cpu"), lag=2, window=3)
    seen = []
    for count in [5, 9, 2, 1, 1, 1, 1]:
        est.push(torch.tensor([count]))
        seen.append(est.value())
    assert seen == [None, None, 5, 9, 9, 9, 2]


def test_rows_dropped_by_a_host_tier_join_the_pool_with_the_full_rankings_victims(tmp_path, monkeypatch):
    """A file-backed table's host cache drops device copies of the rows it evicts (EmbeddingCache.drop_rows): the
    emptied slots join the victim pool instead of forcing a full ranking, and the device cache ends in the same
    state (slots, counts, stats) as when every drop re-ranks the whole cache."""
    import numpy as np


    def train(rerank: bool, name: str):
        if rerank:
            monkeypatch.setattr(VictimPool, "include", lambda self, slots, exact: self.invalidate())
        else:
            monkeypatch.undo()
        torch.manual_seed(0)
        emb = cachedemb.CachedEmbeddingBag(3000, 4, mode="sum", cache_rows=60, device="cpu",
                                           optimizer=cachedemb.optim.SGD(lr=0.1),
                                           storage=cachedemb.FileStorage(tmp_path / name, host_cache_bytes=30_000))
        g = np.random.default_rng(5)
        for _ in range(25):
            ids = torch.from_numpy((g.random(96) ** 2 * 3000).astype(np.int64))
            emb(ids, torch.arange(0, 96, 6)).sum().backward()
        c = emb.inner.cache
        out = (c.slot_ids.clone(), c.slot_freq.clone(), c.stats.clone(), emb.export_state_dict()["weight"].clone(),
               emb.host.stats["evicted"], c.victim_pool.rankings)
        emb.close()
        return out

    pooled, ranked = train(False, "a.cemb"), train(True, "b.cemb")
    assert pooled[4] > 0  # the host cache evicted rows, so device copies were dropped
    for a, b in zip(pooled[:4], ranked[:4]):
        assert torch.equal(a, b)
    assert pooled[5] < ranked[5]  # fewer full rankings


@pytest.mark.parametrize("union", ["c", "torch"])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlap"])
def test_window_slots_above_the_bound_leave_the_pool(overlap, union, monkeypatch):
    """One-batch prefetch windows (depth 1): each window's slots join the pool when their protection comes off,
    and those that score above the bound (rows used again soon) leave it at the next served choice. The pool
    stays within its ranking's size plus one window's slots and is rarely ranked again; training equals training
    without prefetch (the pool stays exact)."""
    import numpy as np

    if union == "torch":
        monkeypatch.setattr(pool_native.NATIVE, "enabled", False)
    rng = np.random.default_rng(3)
    p = np.arange(1, 20001, dtype=np.float64) ** -1.05
    p /= p.sum()
    # a cache large against a batch's misses, so the pool (about 9 batches of victims) is a part of it
    batches = [(torch.from_numpy(rng.choice(20000, 900, p=p)), torch.arange(0, 900, 6)) for _ in range(40)]

    def make():
        torch.manual_seed(0)
        return cachedemb.CachedEmbeddingBag(20000, 4, mode="sum", cache_rows=6000, device="cpu",
                                            optimizer=optim.SGD(lr=0.1))

    plain = make()
    for ids, offsets in batches:
        plain(ids, offsets).sum().backward()
    emb = make()
    seen, real_choose = [], VictimPool.choose

    def choose(self, *args, **kwargs):
        if self.policy is not None:  # the pool with the slots that joined it since the last choice
            seen.append((torch.unique(torch.cat([self.slots, *self.joined]).clamp(-1, 6000)).numel() - 1,
                         self.ranked_size))
        return real_choose(self, *args, **kwargs)

    monkeypatch.setattr(VictimPool, "choose", choose)
    windows = 0
    for ids, offsets in cachedemb.prefetch(batches, [emb], depth=1, horizon=8, overlap=overlap):
        emb(ids, offsets).sum().backward()
        windows += 1
    assert torch.equal(emb.weight, plain.weight)
    largest_window = max(int(torch.unique(ids).numel()) for ids, _ in batches)
    assert len(seen) > 20
    assert all(size <= ranked + largest_window for size, ranked in seen), seen
    assert emb.cache.victim_pool.rankings < windows // 4


@pytest.mark.parametrize("seed", range(5))
def test_pool_union_in_c_is_the_set_union(seed):
    """pool_native.union: the pool, then the new in-range slots not in it, each once (a window's slots may repeat
    across the windows joined at once, and host locations lie outside [0, C)); the mark is left all False."""
    if pool_native.union(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 1,
                         torch.zeros(1, dtype=torch.bool)) is None:
        pytest.skip("C helpers off: the torch union runs")
    g = torch.Generator().manual_seed(seed)
    C = 500
    pool = torch.randperm(C, generator=g)[: int(torch.randint(0, C, (1,), generator=g))]
    slots = torch.randint(-3, C + 3, (int(torch.randint(0, 2 * C, (1,), generator=g)),), generator=g)
    mark = torch.zeros(C, dtype=torch.bool)
    got = pool_native.union(pool, slots, C, mark)
    assert got[: pool.numel()].tolist() == pool.tolist()
    expected = set(pool.tolist()) | {s for s in slots.tolist() if 0 <= s < C}
    assert len(got) == len(set(got.tolist())) == len(expected) and set(got.tolist()) == expected
    first = [s for i, s in enumerate(slots.tolist()) if 0 <= s < C and s not in set(pool.tolist())
             and s not in slots.tolist()[:i]]
    assert got[pool.numel():].tolist() == first
    assert not mark.any()


@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_pool_rescore_in_c_is_the_union_scored_and_pruned(kind, seed):
    """pool_native.rescore: the union of pool_native.union, each entry's policy score (the torch policy over the
    view) under its slot's protection, the entries scoring <= bound or PROTECTED in union order, and how many
    of them are not PROTECTED; the mark is left all False."""
    g = random.Random(seed)
    C = 400
    slots = Slots(C, g)
    policy = POLICIES[["lfu", "lru", "lookahead"][kind]]
    if pool_native.kind(policy) != kind:
        pytest.skip("C helpers off")
    protected = torch.rand(C + 1, generator=torch.Generator().manual_seed(seed)) < 0.2  # + the dump element
    pool = torch.tensor(g.sample(range(C), 150), dtype=torch.int64)
    joined = torch.tensor([g.randrange(-3, C + 3) for _ in range(200)], dtype=torch.int64)
    scores = policy(slots.view(None, protected[:C]))
    for bound in [int(scores.kthvalue(60).values), PROTECTED - 1, PROTECTED]:
        mark = torch.zeros(C, dtype=torch.bool)
        got = pool_native.rescore(kind, pool, joined, C, slots.ids, slots.freq, slots.last, slots.next, protected,
                                  bound, mark)
        union = pool_native.union(pool, joined, C, torch.zeros(C, dtype=torch.bool))
        assert torch.equal(got.union, union)
        assert torch.equal(got.score, policy(slots.view(union, protected[union])))
        keep = (got.score <= bound) | (got.score == PROTECTED)
        assert torch.equal(got.kept, union[keep]) and torch.equal(got.kept_score, got.score[keep])
        assert got.n_valid == int(((got.score <= bound) & (got.score < PROTECTED)).sum())
        assert not mark.any()


def test_where_counts_are_on_the_host_the_pool_keeps_two_batches_or_every_slot():
    """The host path's pool: a batch's k victims past its hits plus two more batches of k (re-scoring a larger
    pool each batch cost more than the rankings it saved); past a third of the cache, every slot (scored in
    order, not gathered). The victims stay the brute force's either way."""
    g = random.Random(11)
    C = 900
    slots = Slots(C, g)
    pool = VictimPool(C, "cpu")  # the cache's default (8 batches under the CUDA rules)
    protected = torch.zeros(C, dtype=torch.bool)
    hit = torch.tensor(g.sample(range(C), 20))
    protected[hit] = True
    for k, size in [(30, 20 + 30 + 2 * 30), (100, C)]:
        pool.invalidate()
        victims = pool.choose(POLICIES["lfu"], slots.view, unprotect(POLICIES["lfu"], slots, protected),
                              at(protected), k, torch.tensor([k]), 20, True)
        assert victims[:k].tolist() == brute_force(POLICIES["lfu"], slots, protected, k)
        assert pool.slots.numel() == size
    assert torch.equal(pool.slots, torch.arange(C))  # 20 + 100 + 200 > C / 3: every slot


def capped_metadata(c, seed):
    """Slot metadata with counts and uses past the policies' caps (the look-ahead's 2^24 count, the tier)."""
    g = torch.Generator().manual_seed(seed)
    slot_ids = torch.randint(-1, 50, (c + 1,), generator=g)
    freq = torch.randint(0, 100, (c + 1,), generator=g)
    freq[:3] = torch.tensor([(1 << 24) + 5, (1 << 33) + 1, 1 << 62])
    last_use = torch.randint(0, 1000, (c + 1,), generator=g)
    last_use[3] = (1 << 34)
    next_use = torch.randint(-1, 20, (c,), generator=g)
    next_use[4] = (1 << 33)
    protected = torch.rand(c, generator=g) < 0.2
    return slot_ids, freq, last_use, next_use, protected


@pytest.mark.parametrize("policy_name", ["lfu", "lru", "lookahead"])
def test_the_pools_c_rescoring_scores_as_the_policy_past_the_caps(policy_name):
    """pool_native.rescore's scores (slot_score.h) equal the policy's torch code bit for bit where counts and
    uses pass the caps, empty and protected slots included."""
    policy = POLICIES[policy_name]
    if pool_native.kind(policy) is None:
        pytest.skip("the C library is not installed (or CACHEDEMB_NATIVE=0)")
    c = 97
    slot_ids, freq, last_use, next_use, protected = capped_metadata(c, 2)
    pool = torch.randperm(c, generator=torch.Generator().manual_seed(3))[:60]
    got = pool_native.rescore(pool_native.kind(policy), pool, torch.arange(c), c, slot_ids, freq, last_use,
                              next_use, protected, 0, torch.zeros(c, dtype=torch.bool))
    union = torch.cat([pool, torch.tensor(sorted(set(range(c)) - set(pool.tolist())), dtype=torch.int64)])
    assert torch.equal(got.union, union)
    view = SlotView(slot_ids[union], freq[union], last_use[union], next_use[union], protected[union], None, union, c)
    assert torch.equal(got.score, policy(view))
