"""cachedemb/storage/slab_victims.py: the C pass gives the numpy code's eviction candidates and keys (cached rows
not held by a batch in flight and not kept; count, recency and look-ahead bits), and training on a file with
either evicts the same rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cachedemb.storage import slab_victims

pytestmark = pytest.mark.skipif(slab_victims.NATIVE.get() is None, reason="C helpers off: the numpy code runs")


@pytest.mark.parametrize("seed", range(6))
def test_the_c_pass_equals_the_numpy_code(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    row_id = np.where(rng.random(n) < 0.8, rng.integers(0, 10**6, n), -1).astype(np.int64)
    row_step = rng.integers(-1, 40, n).astype(np.int64)
    next_use = rng.integers(-1, 60, n).astype(np.int64)
    freq = rng.integers(0, 1 << 45, n + 7).astype(np.int64)  # longer than the slab, some past the cap
    freq[: n // 3] = rng.integers(0, 50, n // 3)
    row_step[: 5] = (1 << 23)  # past the recency clip
    keep = rng.choice(n, size=int(rng.integers(0, n)), replace=False).astype(np.int64)
    for done_below in (0, 20, 45):
        want = slab_victims.victim_keys_numpy(row_id, row_step, next_use, freq[:n], done_below, keep)
        got = slab_victims.victim_keys(row_id, row_step, next_use, freq, done_below, keep)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert slab_victims.victim_keys(row_id, row_step, next_use, freq, 10, np.empty(0, np.int64))[0].size


def test_training_on_a_file_evicts_the_same_rows(tmp_path, monkeypatch):
    import cachedemb
    from cachedemb import optim

    def train(enabled, name):
        monkeypatch.setattr(slab_victims.NATIVE, "enabled", enabled)
        torch.manual_seed(0)
        emb = cachedemb.CachedEmbeddingBag(
            2000, 8, mode="sum", cache_rows=64, device="cpu", optimizer=optim.Adagrad(lr=0.1),
            storage=cachedemb.FileStorage(tmp_path / name, host_cache_bytes=40_000))
        g = torch.Generator().manual_seed(3)
        for _ in range(10):
            ids = (torch.rand(120, generator=g) ** 2 * 2000).long()
            emb(ids, torch.arange(0, 120, 6)).sum().backward()
        stats = {k: v for k, v in emb.host.stats.items() if k != "from_writes"}  # timing: writes still in flight
        out = (emb.export_state_dict()["weight"].clone(), stats, emb.host.row_id.copy())
        emb.close()
        return out

    (w1, s1, r1), (w2, s2, r2) = train(True, "a.cemb"), train(False, "b.cemb")
    assert torch.equal(w1, w2)
    assert s1 == s2 and s1["evicted"] > 0
    assert np.array_equal(r1, r2)
