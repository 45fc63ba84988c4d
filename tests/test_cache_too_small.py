"""CacheTooSmallWarning: once per module when a batch's distinct ids exceed the cache rows, naming a cache that
would hold the batch; never for a cache that holds it. Under the CUDA rules (sync_free) it comes from counts
that reached the host without a sync, a couple of batches late."""
import re
import warnings

import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.modules.cache_stats import ratio_holding
from cachedemb.modules.errors import CacheTooSmallWarning

pytestmark = [pytest.mark.usefixtures("sizing_mode")]


def run(emb, data):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids, offsets in data:
            emb(ids, offsets).sum().backward()
        stats = emb.cache_stats()
    return [w for w in caught if issubclass(w.category, CacheTooSmallWarning)], stats


def test_a_batch_larger_than_the_cache_warns_once_with_a_ratio_that_holds_it():
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 100_000, (600,), generator=gen), torch.arange(0, 600, 20)) for _ in range(6)]
    distinct = max(torch.unique(ids).numel() for ids, _ in data)
    small = cachedemb.CachedEmbeddingBag(100_000, 4, mode="sum", cache_ratio=0.0001, optimizer=optim.SGD(0.1),
                                         device="cpu")
    assert small.cache.capacity == 10
    warned, stats = run(small, data)
    assert len(warned) == 1 and stats["host_rows"] > 0
    message = str(warned[0].message)
    assert "served from the host" in message and "10 rows" in message
    ratio = float(re.search(r"cache_ratio=([0-9.e-]+)", message).group(1))
    seen = int(re.search(r"looked up (\d+) distinct", message).group(1))
    assert seen <= distinct and seen > 10 and ratio * 100_000 >= seen
    assert ratio == ratio_holding(seen, 100_000) and ratio < 2 * seen / 100_000
    big = cachedemb.CachedEmbeddingBag(100_000, 4, mode="sum", cache_ratio=ratio_holding(distinct, 100_000),
                                       optimizer=optim.SGD(0.1), device="cpu")
    warned, stats = run(big, data)
    assert warned == [] and stats["host_rows"] == 0


def test_ratio_holding_rounds_up_to_two_digits():
    assert ratio_holding(2600, 100_000) == 0.026
    assert ratio_holding(2601, 100_000) == 0.027
    assert ratio_holding(7, 1000) == 0.007
    assert ratio_holding(123_456, 100_000_000) == 0.0013
    assert ratio_holding(999, 1000) == 1.0
