"""Cache statistics: the bounded per-batch history against per-batch snapshots, window figures under prefetch,
timings, and the plot script."""
import importlib.util
import pathlib

import pytest
import torch

import cachedemb
from cachedemb import optim

# Every test here runs under both sizing rules (see conftest.sizing_mode).
pytestmark = [pytest.mark.usefixtures("sizing_mode")]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def batches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [((torch.rand(40, generator=gen) ** 3 * 300).long(), torch.tensor([0, 20])) for _ in range(n)]


def test_history_is_a_bounded_ring_of_per_batch_deltas():
    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=30, optimizer=optim.SGD(0.1), device="cpu",
                                       stats_history=5)
    snapshots = [emb.cache_stats()]
    for ids, offsets in batches(8):
        emb(ids, offsets).sum().backward()
        snapshots.append(emb.cache_stats())
    history = emb.cache_history()
    assert history["batch"] == [4, 5, 6, 7]
    for j, batch in enumerate(history["batch"]):
        for key in ("lookups", "unique", "hits", "misses", "rows_in", "rows_out", "evictions"):
            assert history[key][j] == snapshots[batch + 1][key] - snapshots[batch][key], (key, batch)
    assert emb.cache.history.shape == (5, len(cachedemb.cache.embedding_cache.STAT_NAMES))
    emb.reset_cache_stats()
    assert emb.cache_history()["batch"] == []


def test_short_history_starts_at_batch_zero():
    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=30, device="cpu", stats_history=10)
    with torch.no_grad():
        for ids, offsets in batches(3):
            emb(ids, offsets)
    h = emb.cache_history()
    assert h["batch"] == [0, 1, 2]
    assert sum(h["lookups"]) == emb.cache_stats()["lookups"] == 120


def test_window_figures_and_timings():
    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=120, optimizer=optim.SGD(0.1), device="cpu")
    pipe = cachedemb.prefetch(batches(12), [emb], depth=3, horizon=6)
    for ids, offsets in pipe:
        emb(ids, offsets).sum().backward()
    s = emb.cache_stats()
    assert s["windows"] == sum(1 for k in pipe.window_batches if k > 0) > 0
    # every miss was copied in (by a window or by its batch) or served from the host; every row a window moved
    # in is a miss of the batch that first looked it up
    assert s["rows_in"] + s["host_rows"] == s["misses"]
    assert s["window_misses"] == s["window_rows_in"] > 0
    assert s["hits"] + s["misses"] == s["unique"] and s["hit_rate"] == s["hits"] / s["unique"]
    assert s["seconds"]["lookup"] > 0 and s["seconds"]["prefetch"]["window_admission"] > 0
    assert s["seconds"]["prefetch"]["window_protect"] > 0


def test_plot_script_writes_a_png(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_cache_stats", ROOT / "scripts" / "plot_cache_stats.py")
    plot_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_mod)
    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=30, device="cpu", stats_history=20)
    with torch.no_grad():
        for ids, offsets in batches(20):
            emb(ids, offsets)
    out = tmp_path / "stats.png"
    plot_mod.plot({"lfu": emb.cache_history()}, str(out), smooth=4)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


# A trace small enough to enumerate by hand, in a cache that holds all of it (nothing is evicted): each id is a
# miss the first time a batch looks it up and a hit afterwards, with prefetch or without.
HAND_TRACE = [[1, 2, 3, 3], [2, 3, 4], [4, 5, 4], [1, 5, 6]]
HAND_HITS = [0, 2, 1, 2]  # b1: 2, 3 seen; b2: 4 seen; b3: 1, 5 seen
HAND_MISSES = [3, 1, 1, 1]  # b0: 1, 2, 3; b1: 4; b2: 5; b3: 6


@pytest.mark.parametrize("depth", [0, 1, 2, 4], ids=lambda d: f"depth{d}" if d else "no-prefetch")
def test_hit_rate_counts_each_first_lookup_as_a_miss_with_prefetch_or_without(depth, sizing_mode):
    data = [(torch.tensor(b), torch.tensor([0])) for b in HAND_TRACE]
    emb = cachedemb.CachedEmbeddingBag(20, 4, mode="sum", cache_rows=12, optimizer=optim.SGD(0.1), device="cpu",
                                       stats_history=8)
    source = cachedemb.prefetch(data, [emb], depth=depth, horizon=4) if depth else data
    for ids, offsets in source:
        emb(ids, offsets).sum().backward()
    s = emb.cache_stats()
    assert (s["hits"], s["misses"], s["unique"]) == (sum(HAND_HITS), sum(HAND_MISSES), 11)
    assert s["hit_rate"] == 5 / 11
    assert s["rows_in"] == 6 and s["host_rows"] == 0
    assert (s["windows"] > 0) == bool(depth) and s["window_misses"] == (6 if depth else 0)
    history = emb.cache_history()
    if sizing_mode == "exact" or not depth:  # (under the CUDA rules a window's misses land when it ends)
        assert history["hits"] == HAND_HITS and history["misses"] == HAND_MISSES


@pytest.mark.parametrize("overlap", [False, True])
def test_hit_rate_under_prefetch_equals_a_replay_of_what_was_resident(overlap, sizing_mode):
    """Evictions and windows of several batches: a brute-force replay of the slots before and after each forward
    (a row that became resident since its id was last looked up is a miss, as is one not resident at all)
    gives the module's hits and misses, batch by batch."""
    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=120, optimizer=optim.SGD(0.1), device="cpu",
                                       stats_history=32)
    data = batches(16, seed=4)

    def resident():
        emb.cache.settle()  # a window planned or copied on a host thread lands first
        return set(emb.cache.slot_ids[: emb.cache.capacity].tolist()) - {-1}

    fresh, before_last, hits, misses = set(), set(), [], []
    for ids, offsets in cachedemb.prefetch(data, [emb], depth=3, horizon=6, overlap=overlap):
        now = resident()
        fresh = (fresh | (now - before_last)) & now  # moved in since last seen; evicted ones forgotten
        uniq = set(ids.tolist())
        miss = {i for i in uniq if i not in now or i in fresh}
        hits.append(len(uniq) - len(miss))
        misses.append(len(miss))
        emb(ids, offsets).sum().backward()
        before_last = resident()
        fresh = (fresh - uniq) | (before_last - now - uniq)
    s, history = emb.cache_stats(), emb.cache_history()
    assert s["windows"] > 0 and s["window_misses"] > 0 and s["evictions"] > 0
    if sizing_mode == "exact":  # (under the CUDA rules a window's misses land when it ends: the totals agree)
        assert history["hits"] == hits and history["misses"] == misses
    assert (s["hits"], s["misses"]) == (sum(hits), sum(misses))
    assert s["hit_rate"] == pytest.approx(1 - sum(misses) / s["unique"])


def test_every_timer_has_one_readable_name():
    from cachedemb.cache.counters import SECONDS
    from cachedemb.modules.cache_stats import flat_seconds

    def leaves(layout):
        for v in layout.values():
            yield from (leaves(v) if isinstance(v, dict) else [v])

    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=120, device="cpu")
    internal = list(leaves(SECONDS))
    assert sorted(internal) == sorted(emb.cache.seconds) and len(set(internal)) == len(internal)
    for i, key in enumerate(emb.cache.seconds):
        emb.cache.seconds[key] = float(i + 1)
    seconds = emb.cache_stats()["seconds"]
    assert sum(flat_seconds(seconds).values()) == sum(emb.cache.seconds.values())
    assert seconds["lookup"] == emb.cache.seconds["prepare"]
    assert seconds["prefetch"]["read_ahead"]["next_use_query"] == emb.cache.seconds["prefetch_next_use_query"]
    assert not any(k.startswith("prefetch_") or k in ("prepare", "halve_counts") for k in flat_seconds(seconds))


def test_collection_sums_counters_and_timings_and_recomputes_the_hit_rate():
    from cachedemb import CachedEmbeddingBagCollection, TableConfig
    from cachedemb.modules.cache_stats import flat_seconds

    tables = [TableConfig("a", 200, 4, ["fa"]), TableConfig("b", 100, 8, ["fb"])]  # two groups (two dims)
    coll = CachedEmbeddingBagCollection(tables, cache_rows=40, device="cpu", optimizer=optim.SGD(0.1))
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        feats = {"fa": ((torch.rand(30, generator=gen) ** 2 * 200).long(), torch.tensor([0, 15, 30])),
                 "fb": ((torch.rand(20, generator=gen) ** 2 * 100).long(), torch.tensor([0, 10, 20]))}
        out = coll(feats)
        sum(v.sum() for v in out.values()).backward()
    parts = [bag.cache_stats() for bag in coll.bags]
    total = coll.cache_stats()
    assert len(parts) == 2
    for key in ("lookups", "unique", "hits", "misses", "rows_in", "device_bytes"):
        assert total[key] == sum(p[key] for p in parts), key
    assert total["hit_rate"] == total["hits"] / total["unique"] != parts[0]["hit_rate"]
    flat = [flat_seconds(p["seconds"]) for p in parts]
    assert flat_seconds(total["seconds"]) == {k: flat[0][k] + flat[1][k] for k in flat[0]}
    assert isinstance(total["seconds"]["prefetch"]["read_ahead"]["unique"], float)
