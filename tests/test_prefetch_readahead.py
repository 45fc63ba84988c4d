"""The read-ahead side of cachedemb.prefetch: next-use bookkeeping against a scan of the horizon, memory that
follows the horizon (not the table), window depth chosen from what fits (against a set-based planner), the
per-batch path where one batch does not fit, the read-ahead thread training exactly like the same work done
inline, the forward's unique ids handed over, errors raised in the training loop, stage timings."""
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.cache.ahead import AheadBatch, take_ahead
from cachedemb.cache.embedding_cache import PREFETCH_STAGES
from cachedemb.kernels.unique_ids import unique_ids_torch
from cachedemb.prefetch import NextUseTracker, Prefetcher, host_map
from cachedemb.prefetch.windows import FILL


@pytest.fixture(params=["c", "torch"])
def map_loops(request, monkeypatch):
    """The tracker's per-id loops in C (prefetch/host_map.c, where a compiler exists) and in torch."""
    if request.param == "torch":
        monkeypatch.setattr(host_map.NATIVE, "enabled", False)
    elif host_map.NATIVE.get() is None:
        pytest.skip("C helpers off: the torch loops run")
    return request.param


def scan(sets, i, lo, hi):
    """First batch in [lo, hi) whose id set holds i, -1 for none."""
    for b in range(lo, hi):
        if i in sets[b]:
            return b
    return -1


@pytest.mark.parametrize("num,span,horizon", [(30, 7, 5), (200, 70, 64), (1000, 130, 100), (60, 64, 64),
                                              (60, 65, 60)])
def test_next_use_bookkeeping_matches_a_scan_of_the_horizon(num, span, horizon, map_loops):
    rng = np.random.default_rng(num + span)
    steps = 3 * span
    batches = [torch.unique(torch.from_numpy(rng.integers(0, num, rng.integers(0, 30)))) for _ in range(steps)]
    sets = [set(b.tolist()) for b in batches]
    tracker = NextUseTracker(num, span=span)
    slots = torch.from_numpy(rng.integers(-1, num, 40))
    read = 0
    for now in range(steps):
        while read < min(steps, now + span):
            tracker.enter(read, batches[read])
            read += 1
        end = min(now + horizon, read)
        query = torch.arange(-1, num + 1)
        assert tracker.first_use(query, now, horizon).tolist() == [scan(sets, i, now, end) for i in query.tolist()]
        changed = torch.from_numpy(rng.random(slots.numel()) < 0.3)
        slots = torch.where(changed, torch.from_numpy(rng.integers(-1, num, slots.numel())), slots)
        expected = [scan(sets, i, now, end) if i >= 0 else -1 for i in slots.tolist()]
        assert tracker.slot_uses(slots, now, horizon).tolist() == expected
        if read > now + 3:
            ids = tracker.ring[now + 3][0].tolist()
            assert tracker.used_between(now + 3, now, now + 3).tolist() == [scan(sets, i, now, now + 3) >= 0
                                                                             for i in ids]
            unused = [k for k, i in enumerate(ids) if scan(sets, i, now, now + 3) < 0]
            for budget in (0, len(unused) - 1, len(unused), len(unused) + 5):
                got = tracker.unused_between(now + 3, now, now + 3, budget)
                assert (got is None if len(unused) > max(budget, 0) else got.tolist() == unused), (budget, unused)
    with pytest.raises(ValueError, match="span"):
        tracker.first_use(query, 0, horizon)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("share", [0, None])
def test_slot_uses_moved_on_between_windows_match_a_scan(seed, share, monkeypatch, map_loops):
    """slot_uses keeps its last answer and moves it to the next window's range (O(changed slots + the batches
    that entered or left the range)): windows of 1-4 batches, few slots changing, the read-ahead running ahead
    by a varying distance, the map growing and laid out anew as the id range widens, the source ending. With
    share 0 every call that can moves the last answer on; with the default, only where that is cheaper."""
    from cachedemb.prefetch import next_use

    if share is not None:
        monkeypatch.setattr(next_use, "SLIDE_SHARE", share)
    slides = []
    real_slide = NextUseTracker._slide
    monkeypatch.setattr(NextUseTracker, "_slide", lambda self, *a: slides.append(real_slide(self, *a)) or slides[-1])
    rng = np.random.default_rng(seed)
    span, horizon, steps = 40, 16, 150
    batches = [torch.unique(torch.from_numpy(rng.integers(0, 50 + 20 * b, rng.integers(0, 60))))
               for b in range(steps)]
    sets = [set(b.tolist()) for b in batches]
    tracker = NextUseTracker(None, span=span)
    slots = torch.from_numpy(np.where(rng.random(300) < 0.2, -1, rng.permutation(400)[:300]))
    read, now, calls, relayouts = 0, 0, 0, set()
    while now < steps:
        while read < min(steps, now + horizon + int(rng.integers(0, span - horizon))):
            tracker.enter(read, batches[read])
            read += 1
        # a cache's slots hold distinct ids (-1: empty): changed slots take ids no slot holds
        changed = np.flatnonzero(rng.random(slots.numel()) < rng.choice([0.0, 0.02, 0.3]))
        fresh = np.setdiff1d(rng.permutation(400 + 20 * now), slots.numpy())[: changed.size]
        slots = slots.clone()
        slots[changed[: fresh.size]] = torch.from_numpy(np.where(rng.random(fresh.size) < 0.1, -1, fresh))
        end = min(now + horizon, read)
        expected = [scan(sets, i, now, end) if i >= 0 else -1 for i in slots.tolist()]
        got = tracker.slot_uses(slots, now, horizon)
        assert got.tolist() == expected, (now, read)
        got.fill_(7)  # the caller's copy: changing it changes nothing kept
        relayouts.add(tracker.map.relayouts)
        calls += 1
        now += int(rng.integers(1, 5))
    assert calls > 40 and len(relayouts) > 1
    if share == 0:
        assert sum(s is not None for s in slides) > calls // 3  # the moved-on answers were checked


def test_next_use_bookkeeping_holds_the_horizon_not_the_table(map_loops):
    """A 1B-row table and a 1M-row one with the same batches' worth of distinct ids cost the same; nothing in the
    tracker is sized by the table."""
    g = torch.Generator().manual_seed(0)
    span, per_batch = 20, 500
    sizes = {}
    for rows in (10**6, 10**9):
        tracker = NextUseTracker(rows, span=span)
        for b in range(5 * span):
            tracker.enter(b, torch.unique(torch.randint(0, rows, (per_batch,), generator=g)))
        tracker.slot_uses(torch.randint(0, rows, (300,), generator=g), 4 * span + 1, span - 1)
        sizes[rows] = tracker.nbytes()
        held = [tracker.map.keys, tracker.map.words, tracker.map.pinned]
        held += [t for entry in tracker.ring.values() for t in entry[:2]] + list(tracker._slots[:2])
        assert max(t.numel() for t in held) < 64 * span * per_batch
    assert sizes[10**9] <= 2 * sizes[10**6]
    assert sizes[10**9] < 200 * span * per_batch  # bytes per distinct id held, whatever the table


def test_id_map_keeps_what_a_dict_keeps(map_loops):
    """Inserts, finds and drops of ids coming and going (TOMBs reused, the map grown and laid out anew) answer as
    a dict does, with the per-id loops in C and in torch."""
    from cachedemb.prefetch.id_map import IdMap

    rng = np.random.default_rng(3)
    m, ref = IdMap(2), {}
    for step in range(60):
        ids = torch.from_numpy(np.unique(rng.integers(0, 5000 + 300 * step, rng.integers(1, 400))))
        m.reserve(ids.numel())
        pos = m.find(ids)
        absent = (pos < 0).nonzero().squeeze(1)
        assert sorted(ids[absent].tolist()) == sorted(set(ids.tolist()) - set(ref))
        if absent.numel():
            layout = m.relayouts
            pos[absent] = m.insert(ids[absent])
            assert m.relayouts == layout  # reserve made room: positions found before stay valid
        m.words[pos, step % 2] += 1
        for i in ids.tolist():
            ref[i] = ref.get(i, 0) + 1
        leaving = ids[torch.from_numpy(rng.random(ids.numel()) < 0.5)]
        at = m.find(leaving)
        m.words[at] = 0
        m.drop_empty(at)
        for i in leaving.tolist():
            del ref[i]
        live = m.keys >= 0
        assert sorted(m.keys[live].tolist()) == sorted(ref)
        query = torch.from_numpy(rng.integers(0, 5000 + 300 * step, 500))
        found = m.find(query)
        assert [int(f) >= 0 for f in found] == [q in ref for q in query.tolist()]
        assert torch.equal(m.keys[found[found >= 0]], query[found >= 0])
        assert m.used == int((m.keys[: m.none] != -1).sum())  # ids and TOMBs: what the growth test counts
    assert m.relayouts > 1


def test_id_map_of_ids_coming_and_going_is_not_laid_out_again(map_loops):
    """A horizon sliding on: as many ids leave as enter each step. In C a TOMB that ends no probe becomes EMPTY,
    so the map stays within its size without relayouts (each moves every position its owner holds); the torch
    loops leave TOMBs to the next relayout. Either way the map answers as a set does."""
    from cachedemb.prefetch.id_map import IdMap

    rng = np.random.default_rng(5)
    m, live, fresh = IdMap(1), [], 0
    for step in range(300):
        ids = torch.arange(fresh, fresh + 300) * 7919 % 10**9
        fresh += 300
        m.reserve(ids.numel())
        m.words[m.insert(ids), 0] = 1
        live.append(ids)
        if len(live) > 10:
            leaving = live.pop(0)
            at = m.find(leaving)
            m.words[at] = 0
            m.drop_empty(at)
        if step == 20:
            settled = m.relayouts
        assert m.used == int((m.keys[: m.none] != -1).sum())
    held = torch.cat(live)
    assert bool((m.find(held) >= 0).all()) and int((m.keys >= 0).sum()) == held.numel()
    if map_loops == "c":
        assert m.relayouts == settled and m.used < 2 * held.numel()
    else:
        assert m.relayouts > settled


def test_a_c_insert_that_would_leave_the_tail_changes_nothing():
    c = host_map.NATIVE.get()
    if c is None:
        pytest.skip("C helpers off")
    keys = torch.full((20,), -1, dtype=torch.int64)
    keys[:18] = torch.arange(100, 118)
    keys[3] = -2  # a TOMB the first insert may take
    before = keys.clone()
    pos, reused = host_map.insert(c, keys, 4, 19, torch.tensor([7, 8, 9]))
    assert pos is None and reused == 0 and torch.equal(keys, before)
    pos, reused = host_map.insert(c, keys, 4, 19, torch.tensor([7]))
    assert pos is not None and keys[pos].tolist() == [7]

def window_reference(batches, capacity, depth):
    """The windows a set-based planner picks: the most batches (<= depth) whose union fits (one batch: the
    cache; more: FILL of it), 0 where one batch alone does not fit."""
    sets = [set(torch.unique(b).tolist()) for b in batches]
    out, start = [], 0
    while start < len(sets):
        union, count = set(), 0
        for k in range(min(depth, len(sets) - start)):
            grown = union | sets[start + k]
            if len(grown) > (capacity if k == 0 else int(capacity * FILL)):
                break
            union, count = grown, count + 1
        out.append(count)
        start += max(count, 1)
    return out


def mixed_batches(num, steps, seed, sizes=(4, 40)):
    """Batches of `sizes[0]`..`sizes[1]` lookups (Zipf-like ids); sizes=None mixes tiny batches of a few hot ids,
    medium ones and ones of ~60 distinct ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if sizes is None:
            kind = float(torch.rand(1, generator=g))
            if kind < 0.5:
                ids = (torch.rand(4, generator=g) ** 3 * 20).long()
            elif kind < 0.8:
                ids = (torch.rand(16, generator=g) ** 2 * num).long()
            else:
                ids = torch.randperm(num, generator=g)[:60]
        else:
            n = int(torch.randint(sizes[0], sizes[1], (1,), generator=g))
            ids = (torch.rand(n, generator=g) ** 2 * num).long()
        out.append((ids, torch.tensor([0, ids.numel() // 2])))
    return out


def make(num=300, cache_rows=40, seed=0):
    torch.manual_seed(seed)
    return cachedemb.CachedEmbeddingBag(num, 4, mode="sum", cache_rows=cache_rows, device="cpu",
                                        optimizer=optim.Adagrad(lr=0.1))


def train(emb, source):
    for ids, offsets in source:
        emb(ids, offsets).pow(2).sum().backward()
    return emb.weight.detach().clone()


@pytest.mark.usefixtures("sizing_mode")
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_windows_are_the_most_batches_that_fit(depth, map_loops):
    batches = mixed_batches(300, 40, seed=depth, sizes=None)
    emb = make(cache_rows=40)
    pipe = cachedemb.prefetch(batches, [emb], depth=depth, horizon=8, overlap=False)  # one window at a time
    cache = emb.cache
    start = 0
    for i, (ids, offsets) in enumerate(pipe):
        if i == start:
            count = pipe.window_batches[-1]
            union = set(torch.cat([b[0] for b in batches[i:i + max(count, 1)]]).tolist())
            protected = set(cache.slot_ids[: cache.capacity][cache.protected[: cache.capacity]].tolist())
            if count:  # exactly the window is protected, and it fits
                assert protected == union and len(union) <= (40 if count == 1 else 20)
            else:
                assert protected == set() and len(union) > 40
            start += max(count, 1)
        emb(ids, offsets).pow(2).sum().backward()
    assert pipe.window_batches == window_reference([b[0] for b in batches], 40, depth)
    assert 0 in pipe.window_batches and max(pipe.window_batches) >= min(depth, 3)  # both paths were taken
    assert torch.equal(emb.weight, train(make(cache_rows=40), batches))


@pytest.mark.usefixtures("sizing_mode")
def test_batches_larger_than_the_cache_take_the_per_batch_path():
    batches = mixed_batches(300, 12, seed=5, sizes=(60, 80))  # ~45 distinct ids a batch, 30 cache rows
    emb = make(cache_rows=30)
    pipe = cachedemb.prefetch(batches, [emb], depth=4, horizon=8)
    got = train(emb, pipe)
    assert set(pipe.window_batches) == {0} and len(pipe.window_batches) == len(batches)
    stats = emb.cache_stats()
    assert stats["windows"] == 0 and stats["host_rows"] > 0  # the per-batch path served misses from the host
    assert torch.equal(got, train(make(cache_rows=30), batches))


@pytest.mark.usefixtures("sizing_mode")
@pytest.mark.parametrize("overlap", [False, True])
def test_read_ahead_thread_trains_like_the_same_work_inline(overlap):
    """The thread changes when the read-ahead work runs, never what it decides: the same tables and the same
    rows moved as running it on the training thread, and the same table as no prefetch at all."""
    batches = mixed_batches(300, 40, seed=1, sizes=(5, 25))
    runs = []
    for threaded in (True, False):
        emb = make(cache_rows=50)
        pipe = Prefetcher(batches, [emb], depth=3, horizon=10, overlap=overlap, threaded=threaded)
        weight = train(emb, pipe)
        stats = emb.cache_stats()
        runs.append((weight, {k: stats[k] for k in ("rows_in", "rows_out", "evictions", "windows",
                                                    "window_rows_in", "hits", "misses")}, pipe.window_batches))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1] and runs[0][2] == runs[1][2]
    assert torch.equal(runs[0][0], train(make(cache_rows=50), batches))


def test_the_forward_takes_the_unique_ids_and_slots_handed_over(monkeypatch):
    """CPU, counts on the host: each yielded batch's forward takes the unique ids computed ahead (and its slots
    inside a window) instead of sorting again; the table is the same."""
    monkeypatch.delenv("CACHEDEMB_SYNC_FREE", raising=False)
    monkeypatch.delenv("CACHEDEMB_BACKEND", raising=False)
    batches = mixed_batches(300, 20, seed=2, sizes=(5, 15))
    from cachedemb import kernels
    calls = {"unique": 0, "place": 0}
    real_unique = kernels.unique_ids
    emb = make(cache_rows=60)
    real_place = emb.cache._place

    def counting_unique(*args, **kwargs):
        calls["unique"] += 1
        return real_unique(*args, **kwargs)

    def counting_place(*args, **kwargs):
        calls["place"] += 1
        return real_place(*args, **kwargs)

    monkeypatch.setattr(kernels, "unique_ids", counting_unique)
    monkeypatch.setattr(emb.cache, "_place", counting_place)
    pipe = Prefetcher(batches, [emb], depth=2, horizon=6, threaded=False)
    got = train(emb, pipe)
    windows, alone = sum(1 for c in pipe.window_batches if c), pipe.window_batches.count(0)
    assert windows >= 5
    assert calls["unique"] == 0  # every forward took its unique ids
    # the windows' admissions and the per-batch path's forwards only: every forward in a window took its slots
    assert calls["place"] == windows + alone
    assert torch.equal(got, train(make(cache_rows=60), batches))


def test_a_hand_off_that_does_not_match_is_not_taken():
    ids = torch.tensor([5, 3, 5, 9])
    unique = unique_ids_torch(ids, None, return_groups=True)
    slot_ids = torch.tensor([9, 3, 5, -1, -1])
    loc = torch.tensor([1, 2, 0])
    assert take_ahead(AheadBatch(ids, unique, loc), ids.clone(), None, slot_ids)[1] is loc
    assert take_ahead(AheadBatch(ids, unique, loc), torch.tensor([5, 3, 5, 8]), None, slot_ids) is None
    assert take_ahead(AheadBatch(ids, unique, loc), ids.clone(), 3, slot_ids) is None  # padding: its own unique
    moved = torch.tensor([9, 4, 5, -1, -1])  # id 3's slot changed hands: the unique ids still serve
    taken = take_ahead(AheadBatch(ids, unique, loc), ids.clone(), None, moved)
    assert taken is not None and taken[1] is None


def read_ahead_threads():
    return [t for t in threading.enumerate() if t.name == "cachedemb-read-ahead"]


def test_read_ahead_errors_surface_in_the_loop_and_end_it(monkeypatch):
    batches = mixed_batches(300, 20, seed=3, sizes=(5, 15))
    emb = make(cache_rows=60)
    real = NextUseTracker.enter

    def failing(self, batch, uniq):
        if batch == 9:
            raise RuntimeError("read-ahead failed at batch 9")
        return real(self, batch, uniq)

    monkeypatch.setattr(NextUseTracker, "enter", failing)
    trained = 0
    with pytest.raises(RuntimeError, match="batch 9"):
        for ids, offsets in cachedemb.prefetch(batches, [emb], depth=2, horizon=4):
            emb(ids, offsets).sum().backward()
            trained += 1
    assert trained < 9 and not read_ahead_threads()
    assert not bool(emb.cache.protected.any()) and emb.cache.ahead is None
    monkeypatch.setattr(NextUseTracker, "enter", real)
    for ids, offsets in cachedemb.prefetch(batches, [emb], depth=2, horizon=4):  # the module trains on
        emb(ids, offsets).sum().backward()


@pytest.mark.parametrize("fail_at", ["next_use", "plan"])
def test_a_window_planned_in_the_background_that_fails_ends_the_loop_cleanly(fail_at, monkeypatch):
    """A window planned on the copier whose next uses fail on the read-ahead thread (or whose own planning fails)
    raises that error in the loop, and the loop still releases everything: no thread left, no protection, no
    hand-off; the module trains on in a new loop, equal to a module trained without prefetch."""
    from cachedemb.cache.embedding_cache import EmbeddingCache
    from cachedemb.prefetch.read_ahead import ReadAhead

    batches = mixed_batches(300, 24, seed=13, sizes=(5, 15))
    emb, plain = make(cache_rows=60), make(cache_rows=60)
    calls = []
    real_next_use, real_plan = ReadAhead._next_use, EmbeddingCache.plan_window

    def failing_next_use(self, now, snapshots):
        calls.append(now)
        if len(calls) == 3:
            time.sleep(0.05)  # the copier is already waiting for it
            raise RuntimeError("next uses failed")
        return real_next_use(self, now, snapshots)

    def failing_plan(self, *args, **kwargs):
        if threading.current_thread().name == "cachedemb-window-copy":
            calls.append("plan")
            if calls.count("plan") == 2:
                raise RuntimeError("planning failed")
        return real_plan(self, *args, **kwargs)

    if fail_at == "next_use":
        monkeypatch.setattr(ReadAhead, "_next_use", failing_next_use)
    else:
        monkeypatch.setattr(EmbeddingCache, "plan_window", failing_plan)
    trained = 0
    ended = []
    emb.on_prefetch_end = lambda: ended.append(True)  # what a sharded module hears, to drop what it queued
    with pytest.raises(RuntimeError, match="failed"):
        for ids, offsets in cachedemb.prefetch(batches, [emb], depth=2, horizon=4):
            emb(ids, offsets).sum().backward()
            plain(ids, offsets).sum().backward()
            trained += 1
    assert trained < len(batches) and ended == [True]
    del emb.on_prefetch_end
    assert not read_ahead_threads() and not window_copy_threads()
    assert not bool(emb.cache.protected.any()) and emb.cache.ahead is None and not emb.cache._windows
    assert emb.cache._deferred is None and emb.cache._background is None
    monkeypatch.setattr(ReadAhead, "_next_use", real_next_use)
    monkeypatch.setattr(EmbeddingCache, "plan_window", real_plan)
    rest = batches[trained:]
    for ids, offsets in cachedemb.prefetch(rest, [emb], depth=2, horizon=4):  # the module trains on
        emb(ids, offsets).sum().backward()
    if fail_at == "next_use":  # (a plan that failed half-way may have left its window's slots half-placed)
        for ids, offsets in rest:
            plain(ids, offsets).sum().backward()
        assert torch.equal(train(emb, []), train(plain, []))


def test_leaving_the_loop_stops_the_read_ahead_thread():
    emb = make(cache_rows=60)
    for i, (ids, offsets) in enumerate(cachedemb.prefetch(mixed_batches(300, 30, seed=4), [emb], depth=2,
                                                          horizon=8)):
        assert len(read_ahead_threads()) == 1
        emb(ids, offsets).sum().backward()
        if i == 5:
            break
    assert not read_ahead_threads() and not window_copy_threads()


def window_copy_threads():
    return [t for t in threading.enumerate() if t.name == "cachedemb-window-copy"]


@pytest.mark.usefixtures("sizing_mode")
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_cpu_windows_moved_by_a_host_thread_train_as_without_prefetch(depth):
    """On CPU a threaded pipeline plans each next window during the current one and a host thread moves its rows
    while the step computes; training equals training without prefetch, step by step, and the copies ran on
    that thread, started by the forwards."""
    batches = mixed_batches(300, 30, seed=depth + 10)
    plain, ahead = make(cache_rows=60), make(cache_rows=60)
    copied_on = set()
    real = ahead.cache._move_rows

    def recording(*args, **kwargs):
        copied_on.add(threading.current_thread().name)
        return real(*args, **kwargs)

    ahead.cache._move_rows = recording
    pipe = cachedemb.prefetch(batches, [ahead], depth=depth, horizon=8)
    for (ids, offsets), (ids_a, offsets_a) in zip(batches, pipe):
        out_plain, out_ahead = plain(ids, offsets), ahead(ids_a, offsets_a)
        assert torch.equal(out_plain, out_ahead)
        out_plain.pow(2).sum().backward()
        out_ahead.pow(2).sum().backward()
        assert len(window_copy_threads()) <= 1
    assert pipe.overlap and "cachedemb-window-copy" in copied_on
    assert not window_copy_threads()
    assert torch.equal(train(plain, []), train(ahead, []))


@pytest.mark.parametrize("policy", ["lookahead", "lru"])  # lru: admitted rows' last use decides
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_cpu_windows_are_planned_on_the_copier_as_they_would_be_inline(depth, policy, monkeypatch):
    """With overlap on a CPU cache the next window is planned (victims chosen, slot metadata changed) on the copier
    thread, then moved there, while the current window's batches run; every decision is the one planning it on
    the training thread makes: the same counters and windows as the pipeline run inline, an
    eval forward and a freq halving in the middle (both wait for the plan) included; the same table as no
    prefetch. A loop left early with a plan not started ends cleanly."""
    from cachedemb.cache.embedding_cache import EmbeddingCache

    batches = mixed_batches(300, 40, seed=depth + 40)
    planned_on = []
    real = EmbeddingCache.plan_window

    def recording(self, *args, **kwargs):
        planned_on.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EmbeddingCache, "plan_window", recording)
    probe = torch.arange(300)
    runs = []
    for threaded in (True, False):
        torch.manual_seed(0)
        emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=60, device="cpu", freq_halflife=7,
                                           optimizer=optim.Adagrad(lr=0.1))
        planned_on.clear()
        pipe = Prefetcher(batches, [emb], depth=depth, horizon=8, overlap=True, threaded=threaded, policy=policy)
        evals = []
        for i, (ids, offsets) in enumerate(pipe):
            emb(ids, offsets).pow(2).sum().backward()
            if i % 9 == 4:
                with torch.no_grad():
                    evals.append(emb(probe, torch.arange(300)))
        stats = emb.cache_stats()
        runs.append((emb.weight.detach().clone(), evals, {k: v for k, v in stats.items() if isinstance(v, int)},
                     pipe.window_batches, list(planned_on)))
    (w_bg, e_bg, s_bg, win_bg, on_bg), (w_in, e_in, s_in, win_in, on_in) = runs
    # (a window that does not fit beside the one before it is admitted at its start, on the training thread)
    assert on_bg.count("cachedemb-window-copy") >= len(on_bg) // 2 >= 3
    assert set(on_in) == {"MainThread"}
    assert torch.equal(w_bg, w_in) and all(torch.equal(a, b) for a, b in zip(e_bg, e_in))
    assert s_bg == s_in and win_bg == win_in
    # (the per-batch history may differ in when a window's admission counts: planned on the copier, at its start)
    torch.manual_seed(0)
    plain = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=60, device="cpu", freq_halflife=7,
                                         optimizer=optim.Adagrad(lr=0.1))
    assert torch.equal(w_bg, train(plain, batches))
    # leaving the loop right after a boundary (the next window deferred, not started) plans nothing more
    emb = make(cache_rows=60)
    loop = iter(cachedemb.prefetch(batches, [emb], depth=depth, horizon=8))
    for i, (ids, offsets) in enumerate(loop):
        if i == 2 * depth:
            break
        emb(ids, offsets).pow(2).sum().backward()
    loop.close()
    assert not window_copy_threads()
    assert emb.cache._deferred is None and emb.cache._background is None and not emb.cache._windows


def test_a_window_copy_in_flight_is_not_taken_for_an_outside_holder_of_the_table():
    """A copy in flight holds views of the host table for a moment; the forward counts the table's holders before
    the copy starts, so a pipeline that moves rows meanwhile never switches the module to write-through."""
    emb = make(cache_rows=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ids, offsets in cachedemb.prefetch(mixed_batches(300, 30, seed=5), [emb], depth=1, horizon=8):
            emb(ids, offsets).sum().backward()
    assert not emb._watched


@pytest.mark.parametrize("depth", [2, 4])
def test_a_slow_window_copy_spanning_later_forwards_is_not_taken_for_an_outside_holder(depth):
    """A copy still running when a later forward of its window counts the table's holders (its transient views
    counted among them) is waited for and the count taken again: the module never switches to write-through, whose
    re-read of the batch's rows would drop updates not yet written back; training equals training without
    prefetch. (The copies are slowed here so each one spans the next forwards.)"""
    batches = mixed_batches(300, 30, seed=depth + 20)
    plain, ahead = make(cache_rows=60), make(cache_rows=60)
    real = ahead.cache._move_rows

    def slow(*args, **kwargs):
        if threading.current_thread().name == "cachedemb-window-copy":
            held = ahead.cache.host_weight[:1]  # noqa: F841 -- a view over the table while the copy runs
            time.sleep(0.05)
        return real(*args, **kwargs)

    ahead.cache._move_rows = slow
    pipe = cachedemb.prefetch(batches, [ahead], depth=depth, horizon=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for (ids, offsets), (ids_a, offsets_a) in zip(batches, pipe):
            out_plain, out_ahead = plain(ids, offsets), ahead(ids_a, offsets_a)
            assert torch.equal(out_plain, out_ahead)
            out_plain.pow(2).sum().backward()
            out_ahead.pow(2).sum().backward()
    assert pipe.overlap and not ahead._watched
    assert torch.equal(train(plain, []), train(ahead, []))


def test_the_read_ahead_starts_no_ordered_task_while_a_window_copy_runs(monkeypatch):
    """On a small machine the copy the next window waits for should not share a core with the read-ahead: no
    ordered read-ahead task (a batch entered, next uses) starts while a copy runs, only the urgent forward uniques
    (the copies are slowed to make that visible); training is unchanged."""
    batches = mixed_batches(300, 30, seed=31)
    plain, ahead = make(cache_rows=60), make(cache_rows=60)
    copies, entered = [], []
    real_move = ahead.cache._move_rows

    def slow(*args, **kwargs):
        if threading.current_thread().name != "cachedemb-window-copy":
            return real_move(*args, **kwargs)
        start = time.perf_counter()
        time.sleep(0.05)
        out = real_move(*args, **kwargs)
        copies.append((start, time.perf_counter()))
        return out

    from cachedemb.prefetch.read_ahead import ReadAhead

    def recording(real, name):
        def task(self, *args):
            entered.append((name, time.perf_counter()))
            time.sleep(0.015)  # a backlog of read-ahead tasks when the copy starts
            return real(self, *args)
        return task

    ahead.cache._move_rows = slow
    for name in ("_enter", "_unique", "_next_use"):
        monkeypatch.setattr(ReadAhead, name, recording(getattr(ReadAhead, name), name))
    for (ids, offsets), (ids_a, offsets_a) in zip(batches, cachedemb.prefetch(batches, [ahead], depth=2, horizon=8)):
        plain(ids, offsets).pow(2).sum().backward()
        ahead(ids_a, offsets_a).pow(2).sum().backward()
    assert len(copies) > 5 and len(entered) > 20
    # (a task already past the gate when a copy begins may start within a moment of it)
    assert not [t for name, t in entered for a, b in copies if a + 0.02 < t < b and name != "_unique"]
    assert torch.equal(train(plain, []), train(ahead, []))


def test_an_eval_forward_during_a_window_copy_sees_the_rows_written_back():
    """An unannounced forward (eval) inside the loop waits for the window's copies first: it reads the same
    values as a module trained without prefetch."""
    batches = mixed_batches(300, 30, seed=6)
    plain, ahead = make(cache_rows=60), make(cache_rows=60)
    probe = torch.arange(300)
    pipe = cachedemb.prefetch(batches, [ahead], depth=1, horizon=8)
    for (ids, offsets), (ids_a, offsets_a) in zip(batches, pipe):
        plain(ids, offsets).pow(2).sum().backward()
        ahead(ids_a, offsets_a).pow(2).sum().backward()
        with torch.no_grad():
            assert torch.equal(plain(probe, torch.arange(300)), ahead(probe, torch.arange(300)))


def test_stage_seconds_are_reported():
    emb = make(cache_rows=60)
    assert all(emb.cache.seconds[stage] == 0.0 for stage in PREFETCH_STAGES)
    train(emb, cachedemb.prefetch(mixed_batches(300, 20, seed=6, sizes=(5, 15)), [emb], depth=2, horizon=6))
    assert all(emb.cache.seconds[stage] >= 0.0 for stage in PREFETCH_STAGES)
    prefetch = emb.cache_stats()["seconds"]["prefetch"]
    for stage in ("read", "window_admission"):
        assert prefetch[stage] > 0.0, stage
    for stage in ("unique", "next_use", "window_plan", "next_use_query"):
        assert prefetch["read_ahead"][stage] > 0.0, stage


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_ids_are_read_ahead_without_a_host_sync():
    """Batches already on the GPU: the pipeline copies their ids to the host without blocking (the read-ahead
    thread waits for the copy), so steady-state steps make no host sync; the table equals training without."""
    torch.manual_seed(0)
    num = 20_000
    batches = [((torch.rand(4096, device="cuda") ** 3 * num).long(), torch.arange(0, 4096, 16, device="cuda"))
               for _ in range(24)]

    def model():
        torch.manual_seed(0)
        return cachedemb.CachedEmbeddingBag(num, 16, mode="sum", cache_rows=2000, device="cuda",
                                            validate_inputs=False, optimizer=optim.Adagrad(lr=0.1))

    emb = model()
    for i, (ids, offsets) in enumerate(cachedemb.prefetch(batches, [emb], depth=2, horizon=8)):
        torch.cuda.set_sync_debug_mode("error" if i >= 4 else "default")
        try:
            emb(ids, offsets).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    plain = model()
    for ids, offsets in batches:
        plain(ids, offsets).sum().backward()
    torch.testing.assert_close(emb.weight, plain.weight, rtol=0, atol=0)


_EXIT_OPEN = """
import torch, cachedemb
torch.set_num_threads(1)
emb = cachedemb.CachedEmbeddingBag(1000, 4, mode="sum", cache_rows=100, device="cpu",
                                   optimizer=cachedemb.optim.SGD(lr=0.1))
g = torch.Generator().manual_seed(0)

def batches():
    yield torch.randint(0, 1000, (64,), generator=g)
    while True:  # large batches: the read-ahead thread is inside a sort when the process exits
        yield torch.randint(0, 1000, (4_000_000,), generator=g)

it = iter(cachedemb.prefetch(batches(), [emb], depth=1, horizon=2))
emb(next(it), torch.arange(0, 64, 8)).sum().backward()
print("left open")
"""


_EXIT_IN_WINDOWS = """
import numpy as np, torch, cachedemb
torch.set_num_threads(1)
emb = cachedemb.CachedEmbeddingBag(20000, 4, mode="sum", cache_rows=6000, device="cpu",
                                   optimizer=cachedemb.optim.SGD(lr=0.1))
rng = np.random.default_rng(3)
p = np.arange(1, 20001, dtype=np.float64) ** -1.05
batches = [torch.from_numpy(rng.choice(20000, 900, p=p / p.sum())) for _ in range(40)]
it = iter(cachedemb.prefetch(batches, [emb], depth=1, horizon=8))
for _ in range(12):  # windows planned ahead and protected, the victim pool in use
    emb(next(it), torch.arange(0, 900, 6)).sum().backward()
print("left open")
"""


def test_a_process_exiting_with_a_pipeline_open_exits_cleanly():
    """A loop left early with its pipeline never closed, then the process ends: the read-ahead thread is
    stopped at exit (before, a daemon thread inside a torch op aborted the interpreter's teardown, status
    134)."""
    import subprocess
    import sys

    for script in (_EXIT_OPEN, _EXIT_OPEN, _EXIT_IN_WINDOWS):
        # the last: the loop is collected in the interpreter's last garbage collection, with windows to
        # release (allocating tensors there aborted the process: the pipeline leaves them as they are)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "left open" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_paused_worker_runs_urgent_tasks_and_holds_ordered_ones():
    """While a window copy pauses the read-ahead, a forward's unique ids (urgent) still start; the ordered tasks
    wait for `resume` and then run in submission order."""
    from cachedemb.prefetch.read_ahead import Worker

    worker, ran = Worker(), []
    try:
        worker.pause()
        ordered = [worker.submit(ran.append, f"ordered {i}") for i in range(2)]
        worker.submit(ran.append, "urgent", urgent=True).result(timeout=5)
        time.sleep(0.05)
        assert ran == ["urgent"] and not any(f.done() for f in ordered)
        worker.resume()
        for f in ordered:
            f.result(timeout=5)
        assert ran == ["urgent", "ordered 0", "ordered 1"]
    finally:
        worker.close()
