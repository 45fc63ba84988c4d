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
