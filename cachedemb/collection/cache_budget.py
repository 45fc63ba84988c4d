"""Per-table cache rows for CachedEmbeddingBagCollection: `cache_rows={table: rows}` or `cache_rows="auto"`
(a byte budget split over the tables from sample batches, `cachedemb.sizing`).

A group's cache is the sum of its tables' rows (capped at the group's rows): the collection keeps one cache per
(dim, pooling, dtype) group, and a shared cache of the summed rows does at least about as well as those rows
split between the tables (it gives each table the rows its traffic earns, as the split does; docs/sizing.md).
The plan's group predictions are simulations of exactly that shared cache on the tables' merged trace.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from cachedemb import sizing


def _check_rows(name: str, rows) -> int:
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
        raise ValueError(f"cache_rows[{name!r}] must be a positive int, got {rows!r}")
    return int(rows)


def table_cache_rows(collection, cache_rows, budget_bytes, sample, sizing_options) -> tuple:
    """({table name: rows} or None, the SizingPlan or None) for the collection's `cache_rows` argument."""
    names = [t.name for t in collection.tables]
    if cache_rows != "auto" and (budget_bytes is not None or sample is not None or sizing_options):
        raise ValueError("budget_bytes, sample and sizing are used with cache_rows='auto'; got cache_rows="
                         f"{cache_rows!r}")
    if isinstance(cache_rows, Mapping):
        unknown = sorted(set(cache_rows) - set(names))
        missing = [n for n in names if n not in cache_rows]
        if unknown or missing:
            raise ValueError(f"cache_rows must give rows for every table: unknown {unknown}, missing {missing}; "
                             f"tables are {names}")
        return {n: _check_rows(n, cache_rows[n]) for n in names}, None
    if cache_rows != "auto":
        return None, None
    if budget_bytes is None or sample is None:
        raise ValueError("cache_rows='auto' needs budget_bytes= (device bytes for the caches) and sample= (batches "
                         "of this collection's input: KeyedJaggedTensors, dicts or 2-D id tensors)")
    policy = collection._bag_kwargs["policy"]
    if not isinstance(policy, str):
        raise ValueError("cache_rows='auto' sizes the caches for a built-in policy ('lfu', 'lru', 'lookahead'); "
                         "for a custom one pass cache_rows={table: rows} (e.g. cachedemb.sizing.plan(...).cache_rows)")
    options = dict(sizing_options or {})
    traces = sizing.read_traces(_sample_ids(collection, sample), max_unique=options.pop("max_unique", "auto"),
                                sample_rate=options.pop("sample_rate", 1.0), salt=options.pop("salt", 0))
    id_freq = None
    if collection._freqs is not None:
        id_freq = {t.name: f.numpy() for t, f in zip(collection.tables, collection._freqs) if f is not None}
    groups = [[collection.tables[i].name for i in g.tables] for g in collection._groups]
    # a dynamic table's ids are raw int64 (its slab maps them to rows): sized by its trace, not by a row range
    specs = [sizing.TableSpec.from_config(t) if t.dynamic is None else
             replace(sizing.TableSpec.from_config(t), num_embeddings=None) for t in collection.tables]
    plan = sizing.plan(traces, budget_bytes, specs,
                       optimizer=collection._bag_kwargs["optimizer"], policy=policy, groups=groups, id_freq=id_freq,
                       warmup_ratio=collection._bag_kwargs["warmup_ratio"], **options)
    return plan.cache_rows, plan


def _sample_ids(collection, sample):
    """Per batch {table: rows looked up}, hashed as the forward hashes them."""
    sizes = {t.name: t.num_embeddings for t in collection.tables if t.dynamic is None}
    for ids in sizing.readers.read_batches(sample, collection.tables):
        if collection.hash_ids:
            ids = {n: np.remainder(v, sizes[n]) if n in sizes else v for n, v in ids.items()}
        yield ids


__all__ = ["table_cache_rows"]
