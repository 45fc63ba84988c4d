"""LRU stack distances at batch granularity: one pass gives the LRU miss count at every cache size.

Why: LRU is a stack algorithm (Mattson et al., 1970) also in the simulators' batch model. Its eviction order
(last batch, then id; the lowest goes first) does not depend on the capacity, and a cache of C rows holds, before
each batch, exactly the C highest-ranked ids seen so far (batch ids all jump to the top; rows below keep their
order; an oversized batch keeps its C highest ids, which are the top C). So a batch's distinct id x hits in a cache
of C rows iff its rank r (its 1-based position in that order before the batch) is <= C, and misses(C) = the
number of accesses with r > C (first accesses: r = inf).

Ranks come from a Fenwick tree over access stamps: each batch stamps its distinct ids in ascending id order after
every earlier stamp, so "ranked above x" = "holds a live stamp above x's last one". Vectorized per batch (one
query and two updates of O(log n) numpy steps), O(n log n) in all for n per-batch distinct ids.
"""
from __future__ import annotations

import numpy as np

from cachedemb.sizing.simulators import INF, PreparedTrace, prepare_trace


def _prefix(tree: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Sum of tree entries 1..idx for each idx (tree[0] is 0, so finished lanes add nothing)."""
    idx = idx.copy()
    out = np.zeros(idx.size, dtype=np.int64)
    while idx.size and idx.any():
        out += tree[idx]
        idx -= idx & -idx
    return out


def _add(tree: np.ndarray, idx: np.ndarray, delta: int) -> None:
    n = tree.size - 1
    while idx.size:
        np.add.at(tree, idx, delta)
        idx = idx + (idx & -idx)
        idx = idx[idx <= n]


def lru_stack_distances(trace) -> np.ndarray:
    """Per-batch distinct-id access, batch-major and ascending id within a batch (``PreparedTrace.uniq``
    order): its LRU rank before the batch, ``INF`` for a first access."""
    prep: PreparedTrace = prepare_trace(trace)
    n = prep.unique_lookups
    tree = np.zeros(n + 1, dtype=np.int64)
    latest = np.zeros(prep.num_ids, dtype=np.int64)  # stamp of each id's last access; 0 = never
    out = np.empty(n, dtype=np.int64)
    live = base = 0
    for u in prep.uniq:
        k = u.size
        if not k:
            continue
        prev = latest[u]
        seen = prev > 0
        d = np.full(k, INF, dtype=np.int64)
        if seen.any():
            d[seen] = 1 + live - _prefix(tree, prev[seen])
            _add(tree, prev[seen], -1)
        out[base:base + k] = d
        stamps = np.arange(base + 1, base + k + 1, dtype=np.int64)
        _add(tree, stamps, 1)
        latest[u] = stamps
        live += k - int(np.count_nonzero(seen))
        base += k
    return out


def lru_misses(distances: np.ndarray, sizes) -> np.ndarray:
    """Misses of an LRU cache at each of ``sizes`` (rows; may be fractional for a sampled trace's scaled
    sizes): the accesses whose rank exceeds the size."""
    finite = np.sort(distances[distances < INF])
    cold = distances.size - finite.size
    sizes = np.asarray(sizes, dtype=np.float64)
    return cold + finite.size - np.searchsorted(finite, np.floor(sizes), side="right")


__all__ = ["lru_misses", "lru_stack_distances"]
