"""The look-ahead pipeline: same table as without it (bit-exact on CPU), windows all-hit, shrinking windows,
hazards refused, next-use bookkeeping against brute force, DataLoader batches."""
import numpy as np
import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.prefetch import NextUseTracker

# Every test here runs under both sizing rules (see conftest.sizing_mode).
pytestmark = [pytest.mark.usefixtures("sizing_mode")]


def zipf_batches(num, steps, bags=8, bag_len=5, seed=0, alpha=1.1):
    rng = np.random.default_rng(seed)
    p = np.arange(1, num + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    perm = rng.permutation(num)
    out = []
    for _ in range(steps):
        ids = torch.from_numpy(perm[rng.choice(num, size=bags * bag_len, p=p)])
        out.append((ids, torch.arange(bags) * bag_len))
    return out


def train(emb, batches, wrap=None):
    it = wrap(batches) if wrap else batches
    for ids, offsets in it:
        emb(ids, offsets).tanh().sum().backward()
    return emb.weight.clone()


def make(cache_rows, spec=None, seed=0):
    torch.manual_seed(seed)
    return cachedemb.CachedEmbeddingBag(500, 6, mode="sum", cache_rows=cache_rows, device="cpu",
                                        optimizer=spec or optim.Adam(lr=0.01))


@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlap"])
@pytest.mark.parametrize("depth,horizon", [(1, 1), (2, 8), (4, 16), (7, 64)])
@pytest.mark.parametrize("cache_rows", [40, 90, 200])
def test_prefetch_training_is_bit_exact(depth, horizon, cache_rows, overlap):
    batches = zipf_batches(500, 40)
    plain = train(make(cache_rows), batches)
    emb = make(cache_rows)
    got = train(emb, batches, lambda b: cachedemb.prefetch(b, [emb], depth=depth, horizon=horizon,
                                                           overlap=overlap))
    assert torch.equal(got, plain)


def test_overlap_moves_the_next_window_while_the_current_one_stays_protected():
    batches = zipf_batches(500, 24, bags=4, bag_len=4)
    emb = make(cache_rows=300)
    pipe = cachedemb.prefetch(batches, [emb], depth=4, horizon=16, overlap=True)
    planned_ahead = 0
    for i, (ids, offsets) in enumerate(pipe):
        if i % 4 == 0:
            cache = emb.cache
            resident = cache.slot_ids[: cache.capacity]
            protected_ids = set(resident[cache.protected[: cache.capacity]].tolist())
            current = set(torch.cat([b[0] for b in batches[i:i + 4]]).tolist())
            assert current <= protected_ids
            if pipe.pending is not None:
                planned_ahead += 1
                cache.settle()  # a CPU window may be planned on the copier, started by the next forward
                resident = cache.slot_ids[: cache.capacity]
                protected_ids = set(resident[cache.protected[: cache.capacity]].tolist())
                following = set(torch.cat([b[0] for b in batches[i + 4:i + 8]]).tolist())
                assert following <= set(resident.tolist()) and following <= protected_ids
        emb(ids, offsets).sum().backward()
    assert planned_ahead >= 4
    stats = emb.cache_stats()  # every miss a window's: no forward admitted or served a row itself
    assert stats["misses"] == stats["window_misses"] == stats["rows_in"] and stats["host_rows"] == 0


def test_windows_make_every_forward_a_hit_and_lock_the_window():
    batches = zipf_batches(500, 24, bags=4, bag_len=4)
    emb = make(cache_rows=200)
    pipe = cachedemb.prefetch(batches, [emb], depth=4, horizon=16)
    for i, (ids, offsets) in enumerate(pipe):
        if i % 4 == 0:
            # At a window start every row of the window's batches is resident and protected.
            window = torch.unique(torch.cat([b[0] for b in batches[i:i + 4]]))
            resident = emb.cache.slot_ids[: emb.cache.capacity]
            protected_ids = resident[emb.cache.protected[: emb.cache.capacity]]
            assert set(window.tolist()) <= set(protected_ids.tolist())
        emb(ids, offsets).sum().backward()
    stats = emb.cache_stats()
    # every forward found its rows resident: its misses are the rows its window moved in
    assert stats["misses"] == stats["window_misses"] == stats["rows_in"] > 0 and stats["host_rows"] == 0
    assert stats["hits"] + stats["misses"] == stats["unique"]
    assert pipe.window_batches == [4] * 6
    assert not bool(emb.cache.protected.any()), "protection must be dropped when the pipeline ends"


def test_windows_shrink_and_oversized_batches_take_the_spill_path():
    batches = zipf_batches(500, 12, bags=6, bag_len=5, alpha=0.5)  # ~25 distinct ids per batch
    emb = make(cache_rows=30)
    plain = train(make(cache_rows=30), batches)
    pipe = cachedemb.prefetch(batches, [emb], depth=4, horizon=8)
    got = train(emb, batches, lambda b: pipe)
    assert torch.equal(got, plain)
    assert max(pipe.window_batches) < 4, pipe.window_batches
    tiny = make(cache_rows=5)
    pipe = cachedemb.prefetch(batches, [tiny], depth=2, horizon=4)
    assert torch.equal(train(tiny, batches, lambda b: pipe), train(make(cache_rows=5), batches))
    assert set(pipe.window_batches) == {0}


def test_backward_after_the_next_admission_is_refused():
    batches = zipf_batches(500, 8)
    emb = make(cache_rows=60)
    it = iter(cachedemb.prefetch(batches, [emb], depth=1, horizon=4))
    ids, offsets = next(it)
    out = emb(ids, offsets)
    next(it)  # admits the next window while batch 0's backward is still pending
    with pytest.raises(RuntimeError, match="later forward"):
        out.sum().backward()


def test_next_use_tracker_matches_brute_force():
    rng = np.random.default_rng(0)
    num, steps, horizon = 30, 40, 5
    batches = [torch.unique(torch.from_numpy(rng.integers(0, num, 6))) for _ in range(steps)]
    tracker = NextUseTracker(num)
    read = 0
    for t in range(steps):
        while read < min(steps, t + horizon):
            tracker.enter(read, batches[read])
            read += 1
        for i in range(num):
            future = [b for b in range(t, read) if i in batches[b].tolist()]
            assert int(tracker.next_use[i]) == (future[0] if future else -1), (t, i)
        tracker.retire(t, batches[t])


def test_works_with_a_dataloader_and_an_ids_function():
    batches = zipf_batches(500, 10)

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return len(batches)

        def __getitem__(self, i):
            return batches[i]

    loader = torch.utils.data.DataLoader(Pairs(), batch_size=None)
    emb = make(cache_rows=60)
    got = train(emb, batches, lambda b: cachedemb.prefetch(loader, [emb], depth=3, horizon=6,
                                                           ids=lambda batch: [batch[0]]))
    assert torch.equal(got, train(make(cache_rows=60), batches))


def test_lookahead_moves_fewer_rows_than_lfu():
    batches = zipf_batches(500, 60, bags=8, bag_len=4, seed=3)
    lfu = make(cache_rows=60)
    train(lfu, batches)
    ahead = make(cache_rows=60)
    train(ahead, batches, lambda b: cachedemb.prefetch(b, [ahead], depth=1, horizon=32))
    assert ahead.cache_stats()["rows_in"] < lfu.cache_stats()["rows_in"]


@pytest.mark.parametrize("kwargs,match", [(dict(depth=0), "depth"), (dict(depth=4, horizon=2), "horizon"),
                                          (dict(modules=[]), "modules")])
def test_bad_arguments(kwargs, match):
    emb = make(cache_rows=10)
    args = dict(modules=[emb])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        cachedemb.prefetch([], **args)


def test_lookahead_breaks_count_ties_by_table_size():
    """Two tables share the cache (rows 0..9 and 10..109): among rows with no use ahead and equal counts, the
    larger table's row goes first."""
    from cachedemb.cache.policy import SlotView, lookahead

    emb = cachedemb.CachedEmbeddingBag(110, 2, cache_rows=2, device="cpu")
    emb.cache.set_tables([0, 10])
    emb.cache.preload(torch.tensor([3, 50]))
    c = emb.cache
    view = SlotView(c.slot_ids[:2], torch.tensor([5, 5]), torch.zeros(2, dtype=torch.long),
                    torch.full((2,), -1), torch.zeros(2, dtype=torch.bool), c._table_rank())
    score = lookahead(view)
    assert int(torch.argmin(score)) == int((c.slot_ids[:2] == 50).nonzero()[0, 0])
    with pytest.raises(ValueError, match="table starts"):
        emb.cache.set_tables([1, 10])


def test_prefetch_targets_are_the_ids_the_forward_looks_up():
    """Valid ids come back as they are (no copy needed: the pipeline copies), ids out of range and the padding id
    are dropped, whatever the integer dtype."""
    emb = cachedemb.CachedEmbeddingBag(100, 4, cache_rows=10, device="cpu")
    for dtype in (torch.int64, torch.int32):
        ids = torch.tensor([[1, 2], [99, 0]], dtype=dtype)
        (cache, got), = emb.prefetch_targets((ids, None))
        assert cache is emb.cache and got.tolist() == [1, 2, 99, 0]
        (_, got), = emb.prefetch_targets(torch.tensor([5, 100, -1, 7], dtype=dtype))
        assert got.tolist() == [5, 7]
    padded = cachedemb.CachedEmbeddingBag(100, 4, cache_rows=10, device="cpu", padding_idx=3)
    (_, got), = padded.prefetch_targets({"input": torch.tensor([3, 4, 3, 150])})
    assert got.tolist() == [4]


@pytest.mark.parametrize("loops", ["c", "torch"])
@pytest.mark.parametrize("depth", [1, 2])
def test_window_protection_count_is_kept_in_step_with_the_mask(depth, loops, monkeypatch):
    """Where counts are on the host the protected count moves by each window's slots (O(window), in C where a
    compiler is at hand: place_native.set_protection) instead of being recounted over the cache: at every batch
    it equals the mask's count, and the mask is exactly the current window's resident slots (plus the next
    window's, planned ahead with overlap)."""
    from cachedemb.cache import place_native

    if loops == "torch":
        monkeypatch.setattr(place_native.NATIVE, "enabled", False)
    elif place_native.NATIVE.get() is None:
        pytest.skip("C helpers off: the torch code runs")
    batches = zipf_batches(500, 30, bags=6, bag_len=5, seed=4)
    emb = make(cache_rows=120)
    for ids, offsets in cachedemb.prefetch(batches, [emb], depth=depth, horizon=8, overlap=True):
        cache = emb.cache
        cache.settle()  # the next window may be being planned on the copier
        c = cache.capacity
        assert int(cache._n_protected) == int(cache.protected[:c].sum())
        expected = torch.zeros(c + 1, dtype=torch.bool)
        for loc in cache._windows:
            expected[cache._resident_or_dump(loc)] = True
        assert torch.equal(cache.protected[:c], expected[:c])
        emb(ids, offsets).sum().backward()


def test_a_snapshots_next_uses_are_taken_as_they_are_only_while_no_slot_changed():
    """A window's next uses come from a slot-id snapshot taken one window earlier. While no slot changed since
    (the cache's slot epoch), the read-ahead's tensor is the policy's input as it is (no O(cache) pass on the
    training thread); after a batch admitted rows, the slots whose id changed count as unused, as before."""
    from cachedemb.cache.embedding_cache import SlotNextUse
    from cachedemb.cache.sync_mode import counts_on_host

    emb = cachedemb.CachedEmbeddingBag(100, 4, mode="sum", cache_rows=10, device="cpu", optimizer=optim.SGD(lr=0.1))
    emb(torch.arange(10), torch.tensor([0])).sum().backward()
    cache = emb.cache
    ids, _ = cache.snapshot_slot_ids()
    uses = torch.tensor([-1, 0, 1, 2, 3, -1, 4, 5, 6, 7])
    same = SlotNextUse(ids, uses.clone(), now=3, epoch=cache.slot_epoch)
    cache._set_next_use(same, 3)
    if counts_on_host(cache.device):  # under the CUDA rules the device's op sequence runs every time
        assert cache.next_use is same.uses
    assert torch.equal(cache.next_use, uses)
    emb(torch.arange(50, 55), torch.tensor([0])).sum().backward()  # five slots take other ids
    moved = SlotNextUse(ids, uses.clone(), now=3, epoch=same.epoch)
    cache._set_next_use(moved, 3)
    kept = cache.slot_ids[:10] == ids
    assert int((~kept).sum()) == 5
    assert torch.equal(cache.next_use, torch.where(kept, uses, torch.full_like(uses, -1)))
    with pytest.raises(ValueError, match="batch 4"):
        cache._set_next_use(SlotNextUse(ids, uses.clone(), now=3, epoch=cache.slot_epoch), 4)


@pytest.mark.parametrize("native", [True, False], ids=["c", "torch"])
def test_slot_uses_relative_are_the_first_uses_counted_from_now(native, monkeypatch):
    from cachedemb.prefetch import host_map

    monkeypatch.setattr(host_map.NATIVE, "enabled", native)
    g = np.random.default_rng(2)
    tracker = NextUseTracker(None, span=16)
    for b in range(12):
        tracker.enter(b, torch.from_numpy(np.unique(g.integers(0, 40, 15))))
    slots = torch.from_numpy(g.integers(-1, 45, 30))
    for now in [2, 3, 5]:  # moved on between calls, as windows do
        absolute = NextUseTracker.slot_uses(tracker, slots, now, 6)
        relative = tracker.slot_uses(slots, now, 6, relative=True)
        assert torch.equal(relative, torch.where(absolute >= 0, absolute - now, torch.full_like(absolute, -1)))
        assert (absolute[absolute >= 0] >= now).all() and bool((absolute >= 0).any())
