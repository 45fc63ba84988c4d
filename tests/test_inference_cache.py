"""Inference caches: with `count_in_eval=True` an eval / no_grad module counts its lookups (brute-force bincount)
and its LFU cache comes to hold the ids it serves most; by default eval forwards leave counts alone. Outputs equal
nn.EmbeddingBag either way; the collection passes the flag to its tables."""
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb.collection.table_config import TableConfig

pytestmark = [pytest.mark.usefixtures("sizing_mode")]

NUM, DIM, CACHE = 60, 4, 6


def counts_by_id(cache) -> torch.Tensor:
    """Each id's lookup count wherever it lives: the slot's count if resident, else the host's."""
    counts = cache.host_freq.clone()
    slots = torch.arange(cache.capacity)
    ids = cache.slot_ids[: cache.capacity]
    resident = ids >= 0
    counts[ids[resident]] = cache.slot_freq[slots[resident]]
    return counts


def served_batches(steps=12, lookups=40, seed=0):
    """Skewed traffic: ids 0..CACHE-1 take most lookups."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        hot = torch.randint(0, CACHE, (lookups * 3 // 4,), generator=g)
        cold = torch.randint(CACHE, NUM, (lookups - hot.numel(),), generator=g)
        ids = torch.cat([hot, cold])[torch.randperm(lookups, generator=g)]
        yield ids, torch.arange(0, lookups, 8)


@pytest.mark.parametrize("count_in_eval", [False, True])
def test_eval_forwards_count_only_when_asked(count_in_eval):
    torch.manual_seed(0)
    ref = nn.EmbeddingBag(NUM, DIM, mode="sum")
    ours = cachedemb.CachedEmbeddingBag(NUM, DIM, mode="sum", cache_rows=CACHE, device="cpu",
                                        _weight=ref.weight.detach().clone(), count_in_eval=count_in_eval).eval()
    seen = torch.zeros(NUM, dtype=torch.int64)
    with torch.no_grad():
        for ids, offsets in served_batches():
            torch.testing.assert_close(ours(ids, offsets), ref(ids, offsets), rtol=0, atol=0)
            seen += torch.bincount(ids, minlength=NUM)
    expected = seen if count_in_eval else torch.zeros(NUM, dtype=torch.int64)
    assert torch.equal(counts_by_id(ours.cache), expected)
    resident = set(ours.cache.slot_ids[: CACHE].tolist())
    hottest = set(torch.topk(seen, CACHE).indices.tolist())
    if count_in_eval:
        assert resident == hottest  # the serving cache learned its traffic
    ids, offsets = next(served_batches(steps=1, seed=99))
    before = ours.cache_stats()["hits"]
    with torch.no_grad():
        ours(ids, offsets)
    hits = ours.cache_stats()["hits"] - before
    if count_in_eval:
        assert hits >= len(hottest & set(ids.tolist()))


def test_collection_passes_count_in_eval_to_its_tables():
    tables = [TableConfig(name="t0", num_embeddings=NUM, embedding_dim=DIM, feature_names=["f0"], pooling="sum")]
    coll = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows=CACHE, device="cpu", count_in_eval=True)
    coll.eval()
    ids, offsets = next(served_batches(steps=1))
    with torch.no_grad():
        coll({"f0": (ids, torch.cat([offsets, torch.tensor([ids.numel()])]))})
    (bag,) = coll.bags
    assert bag.count_in_eval
    assert torch.equal(counts_by_id(bag.cache), torch.bincount(ids, minlength=NUM))
