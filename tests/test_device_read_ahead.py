"""The device read-ahead (cachedemb/prefetch/device_read_ahead.py) against the host one: the same windows, the same
next uses, and a pipeline that trains and moves rows exactly as with the host read-ahead. Run here on CPU tensors
(the same torch ops a GPU runs; on a CUDA machine tests/test_gpu.py runs it on the GPU)."""
import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.prefetch import NextUseTracker, Prefetcher
from cachedemb.prefetch.device_read_ahead import DeviceReadAhead, SortedIdsTracker
from cachedemb.prefetch.pipeline import read_ahead_on_device
from cachedemb.prefetch.read_ahead import ReadAhead


def id_batches(num, steps, seed, sizes=(1, 70)):
    """Batches of varying sizes (Zipf-like ids, a few with every id distinct): unions that fit and that do not."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = int(torch.randint(sizes[0], sizes[1] + 1, (1,), generator=g))
        if float(torch.rand(1, generator=g)) < 0.2:
            out.append(torch.randperm(num, generator=g)[:n])
        else:
            out.append((torch.rand(n, generator=g) ** 3 * num).long())
    return out


@pytest.mark.parametrize("span", [5, 12, 64])
def test_sorted_ids_answer_as_the_next_use_map(span):
    """Every question the window planner and the policy ask, over a sliding horizon: unused ids of a batch within
    a budget, and the first use of slot ids (empty slots, ids never seen, ids used only outside the range)."""
    batches = id_batches(200, 40, seed=span)
    host, dev = NextUseTracker(None, span), SortedIdsTracker(span)
    g = torch.Generator().manual_seed(1)
    for b, ids in enumerate(batches):
        uniq = torch.unique(ids)
        host.enter(b, uniq)
        dev.enter(b, uniq)
        assert torch.equal(dev.ring_entry(b)[0], host.ring_entry(b)[0])
        lo = max(0, b + 1 - span)
        for start in {lo, max(lo, b - 3), b}:
            for budget in (0, 5, 1000):
                want = host.unused_between(b, start, b, budget)
                got = dev.unused_between(b, start, b, budget)
                assert (want is None) == (got is None), (b, start, budget)
                if want is not None:
                    assert torch.equal(got, want), (b, start, budget)
        slots = torch.randint(-1, 230, (50,), generator=g)
        for now in {lo, max(lo, b - 2)}:
            for horizon in (1, 4, span):
                for relative in (False, True):
                    want = host.slot_uses(slots, now, horizon, relative=relative)
                    got = dev.slot_uses(slots, now, horizon, relative=relative)
                    assert torch.equal(got, want), (b, now, horizon, relative)
    with pytest.raises(ValueError, match="left the tracker's span"):
        dev.slot_uses(torch.arange(3), len(batches) - span - 1, 2)
    with pytest.raises(ValueError, match="batches enter in order"):
        dev.enter(0, torch.arange(3))


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("depth,capacities", [(1, [30]), (4, [60, 25]), (3, [500])])
def test_device_read_ahead_plans_the_host_windows_and_next_uses(depth, capacities, threaded):
    """Two caches (or one), windows of up to `depth` batches that stop where a union does not fit: the device
    read-ahead's windows (start, count, unions in the same order) and next uses equal the host read-ahead's."""
    steps, horizon = 30, 6
    span = steps + 2  # every batch is entered before the first question here
    per_cache = [id_batches(400, steps, seed=7 + c) for c in range(len(capacities))]
    host = ReadAhead(capacities, depth, horizon, span, locate=False, threaded=threaded)
    dev = DeviceReadAhead(capacities, [torch.device("cpu")] * len(capacities), depth, horizon, span,
                          threaded=threaded)
    try:
        for b in range(steps):
            for ra in (host, dev):
                ra.submit_enter(b, [ids[b].clone() for ids in per_cache])
        for ra in (host, dev):
            ra.submit_end(steps).result()
        start, windows = 0, 0
        g = torch.Generator().manual_seed(3)
        while start < steps:
            want, got = host.window_future(start).result(), dev.window_future(start).result()
            assert (got.start, got.count) == (want.start, want.count)
            assert (got.unions is None) == (want.unions is None)
            if want.unions is not None:
                assert all(torch.equal(a, b) for a, b in zip(got.unions, want.unions))
                windows += 1
            snaps = [(torch.randint(-1, 420, (cap,), generator=g), None) for cap in capacities]
            want_uses = host.submit_next_use(start, snaps).result()
            got_uses = dev.submit_next_use(start, snaps).result()
            assert all(torch.equal(a, b) for a, b in zip(got_uses, want_uses))
            start = want.end
        assert windows > 3
        seconds = dev.take_seconds()
        assert all(s["prefetch_unique"] >= 0 and "prefetch_window_plan" in s for s in seconds)
        with pytest.raises(RuntimeError, match="hands no unique ids"):
            dev.submit_unique(0, [None])
    finally:
        host.close()
        dev.close()


def run_pipeline(batches, depth, cache_rows, policy, monkeypatch, where):
    monkeypatch.setenv("CACHEDEMB_READ_AHEAD", where)
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=cache_rows, device="cpu",
                                       optimizer=optim.Adagrad(lr=0.1))
    pipe = Prefetcher(batches, [emb], depth=depth, horizon=8, policy=policy)
    outs = []
    for ids, offsets in pipe:
        out = emb(ids, offsets)
        outs.append(out.detach().clone())
        out.pow(2).sum().backward()
    assert isinstance(pipe.worker, DeviceReadAhead) == (where == "device")
    stats = {k: v for k, v in emb.cache_stats().items() if isinstance(v, int)}
    return emb.weight.detach().clone(), outs, stats, pipe.window_batches


@pytest.mark.usefixtures("sizing_mode")
@pytest.mark.parametrize("policy", ["lookahead", "lfu"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_pipeline_on_the_device_read_ahead_trains_and_moves_rows_as_on_the_host(depth, policy, monkeypatch):
    """The whole pipeline with the device read-ahead (forced here on a CPU cache, which then takes no forward
    hand-off): the same outputs, table, windows and counters (rows moved in and out, hits) as the host one."""
    g = torch.Generator().manual_seed(depth)
    offsets = torch.arange(0, 48, 6)
    batches = [((torch.rand(48, generator=g) ** 2 * 300).long(), offsets) for _ in range(36)]
    host = run_pipeline(batches, depth, 70, policy, monkeypatch, "host")
    dev = run_pipeline(batches, depth, 70, policy, monkeypatch, "device")
    (w_h, o_h, s_h, win_h), (w_d, o_d, s_d, win_d) = host, dev
    assert torch.equal(w_d, w_h) and all(torch.equal(a, b) for a, b in zip(o_d, o_h))
    assert win_d == win_h and sum(win_h) > 0
    assert s_d == s_h


def test_the_read_ahead_choice(monkeypatch):
    cpu = cachedemb.CachedEmbeddingBag(10, 2, cache_rows=4, device="cpu").cache
    monkeypatch.delenv("CACHEDEMB_READ_AHEAD", raising=False)
    assert not read_ahead_on_device([cpu])  # CPU caches: the host read-ahead (it hands the forward its uniques)
    monkeypatch.setenv("CACHEDEMB_READ_AHEAD", "device")
    assert read_ahead_on_device([cpu])
    monkeypatch.setenv("CACHEDEMB_READ_AHEAD", "gpu")
    with pytest.raises(ValueError, match="CACHEDEMB_READ_AHEAD='gpu': expected 'host' or 'device'"):
        read_ahead_on_device([cpu])


def test_a_collection_prefetched_on_the_device_read_ahead_trains_as_on_the_host(monkeypatch):
    """A collection's several caches (tables of two dims, so two groups) read ahead together on the device read-ahead:
    the same table, windows and counters as the host read-ahead, and as no prefetch."""
    tables = [cachedemb.TableConfig("a", 120, 4, ["fa"]), cachedemb.TableConfig("b", 80, 4, ["fb"]),
              cachedemb.TableConfig("c", 60, 8, ["fc"])]
    g = torch.Generator().manual_seed(5)

    def feature(rows):
        lengths = torch.randint(0, 5, (6,), generator=g)
        values = (torch.rand(int(lengths.sum()), generator=g) ** 2 * rows).long()
        return values, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])

    batches = [{"fa": feature(120), "fb": feature(80), "fc": feature(60)} for _ in range(20)]

    def run(where):
        if where is not None:
            monkeypatch.setenv("CACHEDEMB_READ_AHEAD", where)
        torch.manual_seed(0)
        coll = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows=30, device="cpu",
                                                      optimizer=optim.Adam(lr=0.05))
        source = batches if where is None else Prefetcher(batches, [coll], depth=3, horizon=6)
        for batch in source:
            pooled = coll(batch)
            sum(v.tanh().sum() for v in (pooled.values() if isinstance(pooled, dict) else [pooled.values()])
                ).backward()
        stats = {k: v for k, v in coll.cache_stats().items() if isinstance(v, int)}
        windows = source.window_batches if where is not None else None
        return {k: v.clone() for k, v in coll.state_dict().items()}, stats, windows

    (host, s_host, w_host), (dev, s_dev, w_dev), (plain, _, _) = run("host"), run("device"), run(None)
    assert s_dev == s_host and w_dev == w_host and s_host["windows"] > 0
    assert host.keys() == dev.keys() == plain.keys()
    for key in plain:
        assert torch.equal(dev[key], host[key]) and torch.equal(host[key], plain[key]), key
