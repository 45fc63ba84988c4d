"""The CPU cache's placement bookkeeping and the victim pool's re-scoring in C (cachedemb/cache/place_native.c,
pool_native.c) against the torch code of EmbeddingCache._place and the policies: the same results and the same
cache state after every step (slots, map, metadata, protection, counters, row moves), per batch and through
prefetch windows, at caches from far smaller than a batch to larger than the table, with padding ids and both
victim policies."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.cache import place_native, pool_native

pytestmark = pytest.mark.skipif(place_native.NATIVE.get() is None, reason="C helpers off: the torch code runs")


def batches(num, steps, bags=16, bag_len=6, seed=0, alpha=1.1):
    rng = np.random.default_rng(seed)
    p = np.arange(1, num + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    perm = rng.permutation(num)
    return [torch.from_numpy(perm[rng.choice(num, size=bags * bag_len, p=p)]) for _ in range(steps)]


def state(emb):
    c = emb.cache
    c.settle()  # a window's rows may still be moving on the copier thread
    cap = c.capacity
    return {"rows": c.rows[:cap], "slot_ids": c.slot_ids[:cap], "dirty": c.dirty[:cap],
            "last_use": c.slot_last_use[:cap], "freq": c.slot_freq[:cap], "protected": c.protected[:cap],
            "id_slot": c.id_slot, "stats": c.stats, "host": c.host_weight, "host_freq": c.host_freq,
            **{f"state_{k}": v[:cap] for k, v in c.states.items()}}


def run(native: bool, cache_rows, spec, padding_idx, prefetch, monkeypatch, steps=30):
    monkeypatch.setattr(place_native.NATIVE, "enabled", native)
    monkeypatch.setattr(pool_native.NATIVE, "enabled", native)  # the victims' scores too: the reference is all torch
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=cache_rows, device="cpu", optimizer=spec,
                                       padding_idx=padding_idx)
    data = batches(300, steps)
    offsets = torch.arange(16) * 6
    source = cachedemb.prefetch(data, [emb], **prefetch) if prefetch else data
    outs, states = [], []
    for ids in source:
        out = emb(ids, offsets)
        out.tanh().sum().backward()
        outs.append(out.detach().clone())
        states.append({k: v.clone() for k, v in state(emb).items()})
    return outs, states


@pytest.mark.parametrize("cache_rows", [8, 40, 120, 400])
@pytest.mark.parametrize("prefetch", [None, dict(depth=2, horizon=8), dict(depth=4, horizon=16)],
                         ids=["per-batch", "depth2", "depth4"])
def test_native_placement_equals_the_torch_code(cache_rows, prefetch, monkeypatch):
    if prefetch and cache_rows < 40:
        prefetch = dict(prefetch, depth=1, horizon=4)
    spec, padding_idx = (optim.Adam(lr=0.01), 7) if cache_rows % 3 else (optim.SGD(lr=0.1), None)
    torch_outs, torch_states = run(False, cache_rows, spec, padding_idx, prefetch, monkeypatch)
    c_outs, c_states = run(True, cache_rows, spec, padding_idx, prefetch, monkeypatch)
    for step, (a, b, sa, sb) in enumerate(zip(torch_outs, c_outs, torch_states, c_states)):
        assert torch.equal(a, b), f"outputs differ at step {step}"
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"{key} differs at step {step}"


def test_native_placement_is_used_on_the_cpu_path(monkeypatch):
    """The fast path runs (not silently the torch code): its find is called once per batch with misses or hits."""
    calls = []
    real = place_native.find
    monkeypatch.setattr(place_native, "find", lambda *a, **k: calls.append(1) or real(*a, **k))
    emb = cachedemb.CachedEmbeddingBag(100, 4, mode="sum", cache_rows=10, device="cpu", optimizer=optim.SGD(lr=0.1))
    for ids in batches(100, 3):
        emb(ids, torch.arange(16) * 6).sum().backward()
    assert len(calls) == 3


def test_an_id_outside_the_map_leaves_the_c_loops_and_raises_as_the_torch_code_does():
    emb = cachedemb.CachedEmbeddingBag(50, 4, mode="sum", cache_rows=10, device="cpu", optimizer=optim.SGD(lr=0.1))
    emb(torch.arange(8), torch.tensor([0, 4])).sum().backward()
    cache = emb.cache
    before = cache.protected.clone()
    with pytest.raises(IndexError):
        cache._place(torch.tensor([3, 60]), torch.tensor([2]), cache.policy)
    assert torch.equal(cache.protected, before)  # nothing half-applied by the C loop
    with pytest.raises(IndexError, match="victim slots"):
        found = place_native.find(place_native.NATIVE.get(), torch.tensor([1]), 1, cache.id_slot, cache.capacity,
                                  cache.protected.clone())
        place_native.commit(place_native.NATIVE.get(), found, cache.protected.clone(),
                            torch.tensor([cache.capacity]), 1, cache.capacity, cache.id_slot.clone(), cache.slot_ids.clone(), cache.dirty.clone(),
                            cache.slot_last_use.clone(), 1)


def test_under_the_cuda_rules_no_c_loop_runs(monkeypatch):
    """A CPU run under CACHEDEMB_SYNC_FREE=1 stands for the device's op sequence (launch counts, host-read
    counts): placement, scores and next uses stay torch ops there, the C loops are for the host-count path."""
    monkeypatch.setenv("CACHEDEMB_SYNC_FREE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError("a C loop ran under the CUDA rules")

    monkeypatch.setattr(place_native, "find", refuse)
    monkeypatch.setattr(place_native, "set_protection", refuse)
    monkeypatch.setattr(pool_native, "union", refuse)
    monkeypatch.setattr(pool_native, "rescore", refuse)
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=40, device="cpu", optimizer=optim.SGD(lr=0.1))
    for ids in cachedemb.prefetch(batches(300, 12), [emb], depth=2, horizon=4):
        emb(ids, torch.arange(16) * 6).sum().backward()


@pytest.mark.parametrize("cache_rows", [8, 120])
def test_eval_batches_and_host_served_misses_count_as_the_torch_code_does(cache_rows, monkeypatch):
    """prepare's use counts (cemb_count_uses): training batches count into slots, the host table (misses past a
    small cache) and the dump; eval batches only count lookups. Same counters and counts as the torch code."""
    def trained(native):
        monkeypatch.setattr(place_native.NATIVE, "enabled", native)
        monkeypatch.setattr(pool_native.NATIVE, "enabled", native)
        torch.manual_seed(0)
        emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", cache_rows=cache_rows, device="cpu",
                                           optimizer=optim.SGD(lr=0.1), padding_idx=3)
        offsets = torch.arange(16) * 6
        seen = []
        for step, ids in enumerate(batches(300, 12, seed=1)):
            emb.train(step % 3 != 2)
            with torch.set_grad_enabled(emb.training):
                out = emb(ids, offsets)
                if emb.training:
                    out.sum().backward()
            seen.append({k: v.clone() for k, v in state(emb).items()})
        return seen

    for step, (a, b) in enumerate(zip(trained(False), trained(True))):
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs at step {step}"
