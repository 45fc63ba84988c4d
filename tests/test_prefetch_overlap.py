"""Overlap with staging rows (docs/prefetch.md): the union test, the decisions logged per window at the bench
shape's ratios, rows moved against Belady-OPT at the same cache_rows, bit-exact training on both backends and
sizing modes, the hot path's copy rule, and the read-ahead held around a capture."""
import threading

import numpy as np
import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.cache.policy import lookahead
from cachedemb.prefetch import overlap as overlap_mod
from cachedemb.prefetch import pipeline as pipeline_mod
from cachedemb.prefetch.device_read_ahead import DeviceReadAhead
from cachedemb.prefetch.pipeline import Prefetcher
from cachedemb.prefetch.overlap import CopyLog, CopyPlan, copy_plan, fits_beside, staging_rows_for
from cachedemb.prefetch.read_ahead import ReadAhead, Worker
from cachedemb.sizing.simulators import simulate_opt

# The H200 bench shape scaled down, its ratios kept: 20M rows / 1% cache / a batch's distinct ids 0.675 of the
# cache becomes 200k rows, a 2k-row cache and 2750 Zipf(1.05) lookups a batch.
ROWS, CACHE, LOOKUPS = 200_000, 2000, 2750


def zipf_ids(rows, lookups, steps, seed=0, alpha=1.05):
    rng = np.random.default_rng(seed)
    p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    perm = rng.permutation(rows)
    return [torch.from_numpy(perm[rng.choice(rows, size=lookups, p=p)]) for _ in range(steps)]


def bench_module(rows=ROWS, cache=CACHE, dim=4, spec=None):
    torch.manual_seed(0)
    return cachedemb.CachedEmbeddingBag(rows, dim, mode="sum", cache_rows=cache, device="cpu",
                                        optimizer=spec or optim.Adagrad(lr=0.05))


def run(emb, batches, source=None):
    offsets = torch.arange(0, batches[0].numel(), 10)
    for ids in (source if source is not None else batches):
        emb(ids, offsets).tanh().sum().backward()
    emb.flush()
    return emb.weight.detach().clone()


def distinct(t):
    return set(torch.unique(t).tolist())


# ----------------------------------------------------------------- the union test and its counts
def test_the_union_test_counts_shared_rows_once():
    a, b = set(range(0, 60)), set(range(40, 100))
    assert fits_beside(len(a), len(b - a), slots=100)  # |A or B| = 100 rows fit in 100 slots
    assert len(a) + len(b) > 100  # the sum test refused the same pair
    assert not fits_beside(len(a), len(b - a), slots=99)


@pytest.mark.parametrize("read_ahead", [ReadAhead, DeviceReadAhead], ids=["host", "device"])
@pytest.mark.parametrize("depth", [1, 3])
def test_each_windows_new_rows_are_its_ids_outside_the_window_before_it(read_ahead, depth):
    batches = zipf_ids(3000, 60, 16, seed=1)
    kwargs = dict(locate=False) if read_ahead is ReadAhead else dict(devices=[torch.device("cpu")])
    ra = read_ahead([400], depth=depth, horizon=8, span=32, threaded=False, **kwargs)
    for n, ids in enumerate(batches):
        ra.submit_enter(n, [ids])
    ra.submit_end(len(batches))
    start, prev, checked = 0, None, 0
    while start < len(batches):
        info = ra.window_future(start).result()
        union = set().union(*(distinct(batches[b]) for b in range(start, info.end)))
        before = set() if prev is None else set().union(*(distinct(batches[b]) for b in range(prev.start, prev.end)))
        if info.count:
            assert set(info.unions[0].tolist()) == union
            assert info.new_rows == [len(union - before)]
            checked += prev is not None
        prev, start = info, info.end
    assert checked >= 3


# ----------------------------------------------------------------- decisions at the bench ratios
@pytest.mark.usefixtures("sizing_mode")
def test_every_window_after_the_first_overlaps_at_the_bench_ratios():
    """Each batch's distinct ids ~0.675 of the cache: no two batches fit in cache_rows together (the window is one
    batch, the sum test never overlapped), but each batch plus the next one's new rows fits in cache_rows + the
    staging rows: every window after the first is planned one batch ahead and moved on the side, its
    predecessor's rows locked meanwhile; the counts logged are the sets' sizes."""
    batches = zipf_ids(ROWS, LOOKUPS, 8)
    sizes = [len(distinct(b)) for b in batches]
    assert 0.6 < np.mean(sizes) / CACHE < 0.75
    emb = bench_module()
    loop = cachedemb.prefetch(batches, [emb], depth=4, horizon=16, overlap=True, staging_rows=0.5)
    run(emb, batches, loop)
    staged = emb.cache.capacity
    assert staged == CACHE + CACHE // 2 and emb.cache.cache_rows == CACHE
    decisions = loop.decisions
    assert [d.start for d in decisions] == list(range(len(batches))) and all(d.count == 1 for d in decisions)
    first, rest = decisions[0], decisions[1:]
    assert (first.overlapped, first.stream, first.planned_at, first.why) == (False, "current", 0, "first window")
    for d in rest:
        a, b = distinct(batches[d.start - 1]), distinct(batches[d.start])
        assert d.overlapped and d.stream == "side" and d.planned_at == d.start - 1 and d.why == ""
        assert d.rows == (len(b),) and d.new_rows == (len(b - a),) and d.locked_rows == (len(a),)
        assert d.union_rows == (len(a | b),) and d.union_rows[0] <= d.slots[0] == staged
        assert len(a) + len(b) > CACHE  # what the sum test refused

    # Without staging rows the same batches cannot overlap: the union passes the cache, which the log says.
    emb = bench_module()
    loop = cachedemb.prefetch(batches, [emb], depth=4, horizon=16, overlap=True)
    run(emb, batches, loop)
    assert not any(d.overlapped for d in loop.decisions)
    assert {d.why for d in loop.decisions[1:]} == {"the union with the window in use passes the cache's slots"}
    emb = bench_module()
    loop = cachedemb.prefetch(batches, [emb], depth=4, horizon=16, overlap=False, staging_rows=0.5)
    run(emb, batches, loop)
    assert [d.why for d in loop.decisions[1:]] == ["overlap off"] * (len(batches) - 1)


@pytest.mark.usefixtures("sizing_mode")
def test_overlap_with_staging_moves_no_more_rows_than_belady_opt():
    """At the same cache_rows (staging not counted: at every window's start, after its trim, at most cache_rows
    rows are resident), the overlapped pipeline moves at most 1.02x the rows of batch-granular Belady-OPT; the
    rows of the batch in flight are resident and protected at its yield, and the next batch's too once its move
    ran."""
    batches = zipf_ids(ROWS, LOOKUPS, 10, seed=3)
    opt = simulate_opt([b.numpy() for b in batches], CACHE).rows_moved
    emb = bench_module()
    cache = emb.cache
    resident_after_trim = []
    real_trim = cache.trim_resident

    def trim(policy):
        real_trim(policy)
        resident_after_trim.append(int((cache.slot_ids[: cache.capacity] >= 0).sum()))

    cache.trim_resident = trim
    loop = cachedemb.prefetch(batches, [emb], depth=1, horizon=16, overlap=True, staging_rows=0.5)
    offsets = torch.arange(0, LOOKUPS, 10)
    for i, ids in enumerate(loop):
        slot_ids = cache.slot_ids[: cache.capacity]
        assert distinct(ids) <= set(slot_ids[cache.protected[: cache.capacity]].tolist())
        emb(ids, offsets).tanh().sum().backward()
        if i + 1 < len(batches):
            cache.settle()  # the next window's move (on CPU a host thread, started by the forward)
            assert distinct(batches[i + 1]) <= set(cache.slot_ids[: cache.capacity].tolist())
    stats = emb.cache_stats()
    # every miss is a window's admission (counted at the batch that first needs the row): none at a forward
    assert stats["misses"] == stats["window_misses"] and stats["host_rows"] == 0
    assert sum(d.overlapped for d in loop.decisions) == len(batches) - 1
    assert len(resident_after_trim) == len(batches) + 1  # every window's start and the loop's end
    assert max(resident_after_trim) <= CACHE
    assert stats["rows_in"] <= 1.02 * opt, (stats["rows_in"], opt)


# ----------------------------------------------------------------- exactness
@pytest.mark.usefixtures("sizing_mode")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("depth,lookups,staging", [(1, 100, 0.5), (4, 30, 0.5), (2, 100, 25)],
                         ids=["one-batch-windows", "multi-batch-windows", "staging-below-the-misses"])
def test_training_through_the_staged_overlap_is_bit_exact(monkeypatch, backend, depth, lookups, staging):
    """The same ratios at a size the interpreter runs fast (5000 rows, a 100-row cache); with too few staging
    rows a window's new rows also evict rows no window uses at once: still exact. Triton's interpreter is not
    thread-safe: there the pipeline's work runs on the training thread (threaded=False, the same decisions)."""
    monkeypatch.setenv("CACHEDEMB_BACKEND", backend)
    threaded = backend == "torch"
    batches = zipf_ids(5000, lookups, 14 if threaded else 6, seed=2)
    for spec in (optim.Adam(lr=0.01), optim.Adagrad(lr=0.1))[: 2 if threaded else 1]:
        plain = run(bench_module(5000, 100, 6, spec), batches)
        emb = bench_module(5000, 100, 6, spec)
        loop = Prefetcher(batches, [emb], depth=depth, horizon=8, overlap=True, staging_rows=staging,
                          threaded=threaded)
        assert torch.equal(run(emb, batches, loop), plain)
        assert sum(d.overlapped for d in loop.decisions) >= len(loop.decisions) // 2


def test_the_in_order_pipeline_with_staging_is_bit_exact_and_trims_at_the_end():
    batches = zipf_ids(5000, 100, 10, seed=4)
    plain = run(bench_module(5000, 100), batches)
    emb = bench_module(5000, 100)
    loop = cachedemb.prefetch(batches, [emb], depth=2, horizon=8, overlap=False, staging_rows=30)
    assert torch.equal(run(emb, batches, loop), plain)
    assert emb.cache.capacity == 130 and int((emb.cache.slot_ids[:130] >= 0).sum()) <= 100


# ----------------------------------------------------------------- staging slots
def test_staging_rows_are_checked_before_anything_is_read():
    emb = bench_module(500, 50)
    for bad in (-1, 1.5, float("nan"), "10", True, None):
        with pytest.raises(ValueError, match="staging_rows"):
            cachedemb.prefetch([], [emb], staging_rows=bad)
    assert staging_rows_for(0.5, 101) == 51 and staging_rows_for(7, 101) == 7
    with pytest.raises(ValueError, match="staging_rows"):
        emb.cache.reserve_staging(-3)


def test_reserved_staging_keeps_the_resident_rows_and_counts_in_device_bytes():
    emb = bench_module(500, 50, dim=8)
    ids, offsets = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0)), torch.arange(0, 40, 4)
    emb(ids, offsets).sum().backward()  # rows resident and dirty
    before = emb.cache.device_bytes()
    resident = emb.cache.slot_ids[:50].clone()
    with torch.no_grad():
        want = emb(ids, offsets)
    emb.cache.reserve_staging(20)
    assert emb.cache.capacity == 70 and emb.cache.cache_rows == 50 and emb.cache.staging_rows == 20
    assert torch.equal(emb.cache.slot_ids[:50], resident) and bool((emb.cache.slot_ids[50:70] < 0).all())
    assert emb.cache.device_bytes() > before
    with torch.no_grad():
        assert torch.equal(emb(ids, offsets), want)
    emb.cache.reserve_staging(5)  # never shrinks (a captured graph keeps its addresses)
    assert emb.cache.capacity == 70


def test_the_trim_reads_nothing_on_the_host_under_the_cuda_rules(monkeypatch):
    monkeypatch.setenv("CACHEDEMB_SYNC_FREE", "1")
    monkeypatch.setenv("CACHEDEMB_BACKEND", "triton")
    emb = bench_module(500, 30)
    emb.cache.reserve_staging(10)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 500, (30,), generator=g)
        emb(ids, torch.arange(0, 30, 3)).sum().backward()  # the per-batch path fills the staging slots too
    assert int((emb.cache.slot_ids[:40] >= 0).sum()) == 40
    reads = []
    for name in ("item", "tolist", "cpu", "__int__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, _name=name, **k:
                            (reads.append(_name), _real(t, *a, **k))[1])
    emb.cache.trim_resident(lookahead)
    monkeypatch.undo()
    assert reads == []
    assert int((emb.cache.slot_ids[:40] >= 0).sum()) == 30


# ----------------------------------------------------------------- the hot path's copies
def test_the_copy_rule_pins_and_never_blocks_a_copy_to_a_gpu():
    host = torch.arange(6)
    assert copy_plan(host, torch.device("cpu")) == CopyPlan(False, False, False)
    to_gpu = copy_plan(host, torch.device("cuda", 0))
    assert to_gpu.copy and to_gpu.non_blocking and to_gpu.pin  # a pageable source is pinned first
    log = CopyLog()
    log.record("window ids", to_gpu)
    log.record("same device", CopyPlan(False, False, False))
    log.check()
    assert log.copies == [("window ids", to_gpu)]
    log.record("bad", CopyPlan(True, False, False))
    with pytest.raises(AssertionError, match="blocking"):
        log.check()


def test_the_pipeline_sends_every_read_ahead_result_through_the_copy_rule(monkeypatch):
    """Window ids, next uses and slot snapshots reach the cache's device through overlap.to_device (on a GPU a
    pinned, non-blocking copy; kept on the device when the device read-ahead made them there)."""
    seen = []
    real = overlap_mod.to_device

    def spy(t, device, log=None, site=""):
        seen.append(site)
        return real(t, device, log, site)

    monkeypatch.setattr(pipeline_mod, "to_device", spy)
    batches = zipf_ids(5000, 100, 8, seed=5)
    emb = bench_module(5000, 100)
    loop = cachedemb.prefetch(batches, [emb], depth=1, horizon=8, overlap=True, staging_rows=0.5)
    run(emb, batches, loop)
    windows = len(loop.decisions)
    assert seen.count("window ids") == windows
    assert seen.count("next uses") == seen.count("snapshot ids") == windows
    loop.copies.check()
    assert loop.copies.copies == []  # a CPU cache: nothing crosses to a device


# ----------------------------------------------------------------- capture
def test_a_held_worker_finishes_its_running_task_and_starts_none():
    worker = Worker(name="cachedemb-test-hold")
    started, gate = threading.Event(), threading.Event()
    ran = []
    first = worker.submit(lambda: (started.set(), gate.wait(5), ran.append("first")))
    started.wait(5)
    holder = threading.Thread(target=worker.hold)
    holder.start()
    holder.join(0.2)
    assert holder.is_alive()  # waits for the running task
    gate.set()
    holder.join(5)
    assert not holder.is_alive() and ran == ["first"] and first.done()
    later = worker.submit(lambda: ran.append("urgent"), urgent=True)
    held = threading.Event()
    held.wait(0.2)
    assert not later.done()  # urgent tasks wait too
    worker.release()
    later.result(5)
    assert ran == ["first", "urgent"]
    worker.close()


def test_paused_holds_the_loops_read_ahead_and_refuses_the_next_batch_inside():
    batches = zipf_ids(5000, 100, 6, seed=6)
    emb = bench_module(5000, 100)
    loop = cachedemb.prefetch(batches, [emb], depth=1, horizon=4)
    it = iter(loop)
    ids = next(it)
    offsets = torch.arange(0, 100, 10)
    with loop.paused():
        assert loop.worker.worker.held and not loop.worker.worker.running
        emb(ids, offsets).sum().backward()  # the step itself runs (a capture would be here)
        with pytest.raises(RuntimeError, match="already open"):
            with loop.paused():
                pass
    assert not loop.worker.worker.held
    for ids in it:
        emb(ids, offsets).sum().backward()
    loop = cachedemb.prefetch(batches, [emb], depth=1, horizon=4)
    it = iter(loop)
    next(it)
    with loop.paused(), pytest.raises(RuntimeError, match="inside paused"):
        next(it)
