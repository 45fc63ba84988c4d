"""Predictions against the module: trained on the same trace at the chosen sizes, the module's rows moved per
batch (cache_stats()["rows_in"]) are within 2% (relative) of what the plan predicted, for its default LFU and for
the look-ahead policy under cachedemb.prefetch; and the collection's cache_rows="auto" / {table: rows}."""
import numpy as np
import pytest
import torch

import cachedemb
from cachedemb import sizing
from cachedemb.tools.traces import zipf_trace

BATCHES, LOOKUPS = 40, 1024


@pytest.fixture(scope="module")
def zipf_tables():
    traces = {"a": zipf_trace(30_000, LOOKUPS, BATCHES, 1.05, seed=1), "b": zipf_trace(10_000, LOOKUPS, BATCHES, 0.8,
                                                                                      seed=2),
              "c": zipf_trace(20_000, LOOKUPS, BATCHES, 1.2, seed=3)}
    tables = [cachedemb.TableConfig("a", 30_000, 8, ["fa"]), cachedemb.TableConfig("b", 10_000, 8, ["fb"]),
              cachedemb.TableConfig("c", 20_000, 16, ["fc"])]
    return traces, tables


def _batches(traces):
    return [{f"f{n}": (torch.from_numpy(traces[n][k]), torch.arange(LOOKUPS + 1)) for n in traces}
            for k in range(BATCHES)]


def _train(emb, batches, prefetch=None):
    source = batches if prefetch is None else cachedemb.prefetch(batches, [emb], **prefetch)
    for batch in source:
        out = emb(*batch) if isinstance(batch, tuple) else emb(batch)
        (out.sum() if torch.is_tensor(out) else sum(v.sum() for v in out.values())).backward()


@pytest.mark.parametrize("policy", ["lfu", "lookahead"])
def test_standalone_modules_move_the_rows_predicted(zipf_tables, policy):
    """One CachedEmbeddingBag per table at the plan's rows (groups=None), trained on the trace it was sized
    from: rows moved per batch within 2% of the prediction."""
    traces, tables = zipf_tables
    prefetch = {"depth": 4, "horizon": 16, "overlap": False} if policy == "lookahead" else None
    kw = {k: v for k, v in (prefetch or {}).items()}
    plan = sizing.plan(traces, 300_000, tables, groups=None, optimizer=cachedemb.optim.SGD(0.0), policy=policy,
                       points=12, refine=4, **kw)
    for t in tables:
        rows = plan.cache_rows[t.name]
        assert 1 < rows < t.num_embeddings  # a real choice, not an end of the curve
        emb = cachedemb.CachedEmbeddingBag(t.num_embeddings, t.embedding_dim, cache_rows=rows,
                                           optimizer=cachedemb.optim.SGD(0.0))
        _train(emb, [(torch.from_numpy(b), torch.tensor([0])) for b in traces[t.name]], prefetch)
        measured = emb.cache_stats()["rows_in"] / BATCHES
        predicted = plan.table(t.name).rows_per_batch
        assert measured == pytest.approx(predicted, rel=0.02), (t.name, rows)


def test_collection_auto_sizes_its_group_caches_and_they_move_the_rows_predicted(zipf_tables):
    traces, tables = zipf_tables
    batches = _batches(traces)
    ebc = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows="auto", budget_bytes="300KB", sample=batches,
                                                 optimizer=cachedemb.optim.SGD(0.0), device="cpu",
                                                 sizing={"points": 12, "refine": 4})
    plan = ebc.sizing_plan
    assert plan.budget_bytes == 300_000 and plan.budget_used <= 300_000
    # tables a and b (dim 8) share one cache of their rows summed; c (dim 16) has its own
    assert [g.tables for g in plan.groups] == [("a", "b"), ("c",)]
    assert [bag.cache.capacity for bag in ebc.bags] == [plan.cache_rows["a"] + plan.cache_rows["b"],
                                                        plan.cache_rows["c"]]
    _train(ebc, batches)
    for group, bag in zip(plan.groups, ebc.bags):
        measured = bag.cache_stats()["rows_in"] / BATCHES
        assert measured == pytest.approx(group.rows_per_batch, rel=0.02), group.tables
    # the same sizes by hand
    by_hand = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows=plan.cache_rows, device="cpu")
    assert [bag.cache.capacity for bag in by_hand.bags] == [bag.cache.capacity for bag in ebc.bags]


def test_auto_with_a_warm_start_and_hashed_ids(zipf_tables):
    traces, tables = zipf_tables
    freq = {t.name: np.bincount(np.concatenate(traces[t.name]), minlength=t.num_embeddings) for t in tables}
    # ids past each table, folded in by hash_ids as the forward folds them
    shifted = {n: [b + 3 * t.num_embeddings for b in traces[n]] for n, t in zip(traces, tables)}
    batches = _batches(shifted)
    ebc = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows="auto", budget_bytes=300_000, sample=batches,
                                                 optimizer=cachedemb.optim.SGD(0.0), device="cpu", hash_ids=True,
                                                 id_freq=freq, sizing={"points": 10, "refine": 0})
    plan = ebc.sizing_plan
    assert plan.options == {"warmup_ratio": 0.7}
    ebc.reset_cache_stats()  # the warm-up preload is not the trace's traffic
    _train(ebc, batches)
    for group, bag in zip(plan.groups, ebc.bags):
        assert bag.cache_stats()["rows_in"] / BATCHES == pytest.approx(group.rows_per_batch, rel=0.02)


def test_cache_rows_arguments_are_checked():
    tables = [cachedemb.TableConfig("a", 100, 4), cachedemb.TableConfig("b", 50, 4)]
    ebc = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows={"a": 30, "b": 40}, device="cpu")
    assert ebc.bags[0].cache.capacity == 70 and ebc.sizing_plan is None
    capped = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows={"a": 100, "b": 100}, device="cpu")
    assert capped.bags[0].cache.capacity == 150  # a group's rows at most
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        cachedemb.CachedEmbeddingBagCollection(tables, cache_rows={"a": 3})
    with pytest.raises(ValueError, match="unknown \\['z'\\]"):
        cachedemb.CachedEmbeddingBagCollection(tables, cache_rows={"a": 3, "b": 3, "z": 1})
    with pytest.raises(ValueError, match="must be a positive int"):
        cachedemb.CachedEmbeddingBagCollection(tables, cache_rows={"a": 0, "b": 3})
    with pytest.raises(ValueError, match="needs budget_bytes= .* and sample="):
        cachedemb.CachedEmbeddingBagCollection(tables, cache_rows="auto", budget_bytes=1000)
    with pytest.raises(ValueError, match="used with cache_rows='auto'"):
        cachedemb.CachedEmbeddingBagCollection(tables, cache_rows=10, budget_bytes=1000)
    with pytest.raises(ValueError, match="custom one"):
        cachedemb.CachedEmbeddingBagCollection(tables, cache_rows="auto", budget_bytes=10_000, policy=lambda v: v.freq,
                                               sample=[torch.tensor([[1, 2]])])


def test_meta_collection_keeps_the_per_table_rows_through_materialization():
    tables = [cachedemb.TableConfig("a", 100, 4), cachedemb.TableConfig("b", 50, 4, dtype=torch.float16)]
    ebc = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows={"a": 30, "b": 20}, device="meta")
    ebc.half()  # one group now: the group's cache holds both tables' rows
    ebc.to_empty(device="cpu")
    assert [bag.cache.capacity for bag in ebc.bags] == [50]


def test_auto_sizes_a_dynamic_table_by_its_raw_ids():
    tables = [cachedemb.TableConfig("a", 1000, 4, ["fa"]),
              cachedemb.TableConfig("d", None, 4, ["fd"], dynamic=cachedemb.DynamicIds(capacity=2000))]
    rng = np.random.default_rng(0)
    batches = [{"fa": (torch.from_numpy(rng.integers(0, 1000, 64)), torch.arange(65)),
                "fd": (torch.from_numpy(rng.integers(0, 1 << 50, 64) * 3), torch.arange(65))} for _ in range(8)]
    ebc = cachedemb.CachedEmbeddingBagCollection(tables, cache_rows="auto", budget_bytes=40_000, sample=batches,
                                                 optimizer=cachedemb.optim.SGD(0.1), device="cpu",
                                                 sizing={"points": 6, "refine": 0})
    assert ebc.sizing_plan.table("d").spec.num_embeddings is None
    assert [g.tables for g in ebc.sizing_plan.groups] == [("a",), ("d",)]
    assert ebc.bags[1].cache.capacity == min(ebc.sizing_plan.cache_rows["d"], 2000)
    ebc(batches[0])
