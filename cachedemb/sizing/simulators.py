"""Offline simulation of row-cache eviction policies on id traces, at batch granularity.

Why: choosing a cache policy for an embedding table that lives in host memory is a question of
how many rows cross the host->device link.  Replaying recorded (or synthetic) id traces through
vectorized simulators answers that question in seconds, and Belady-OPT gives the floor.

The cache model, shared by every policy:

* A trace is a sequence of batches (1-D integer arrays of ids, duplicates allowed).  While
  batch ``t`` is processed all of its unique ids ``U_t`` must be resident together.
* A *hit* is a unique id of the batch already resident before the batch, a *miss* one that is
  not.  Each miss moves one row host->device, so per batch ``rows_moved = misses`` (the
  lookahead policy also prefetches rows of the next batches; those count in the batch that
  loads them, so there ``rows_moved`` can exceed ``misses``).
* Rows are loaded on demand and evicted only to make room: if ``U_t`` plus the resident rows
  exceed the capacity, the policy evicts resident rows *not* in the batch, lowest priority first.
* Oversized batch (``|U_t| > capacity``): the batch cannot be resident together.  Every
  non-batch row is evicted, the cache keeps the ``capacity`` ids of ``U_t`` that the policy ranks
  highest (hits are not privileged), and the remaining misses are *streamed*: counted as misses
  and rows moved, but not admitted (``SimResult.streamed`` counts them).  OPT uses the same rule
  and keeps the ids whose next use is soonest.

* ``per_id=True`` also returns each id's rows moved (the sizing tool's sampled-curve estimator needs them).
* Warm start (the module's `id_freq` + `warmup_ratio`): ``preload`` ids are resident before the first batch
  (never accessed: last use -1), and ``initial_counts`` seed the counts of the policies that keep them (lfu,
  lookahead); preloading moves no row in the trace's batches.

Every simulator loops over batches in Python and is vectorized over ids inside a batch
(``np.unique``, fancy indexing, ``np.partition``/``np.lexsort`` over the resident set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = [
    "INF",
    "POLICIES",
    "PreparedTrace",
    "SimResult",
    "murmur3_fmix64",
    "prepare_trace",
    "simulate",
    "simulate_lfu",
    "simulate_lfu_reset",
    "simulate_lookahead",
    "simulate_lru",
    "simulate_opt",
    "simulate_set_lru",
]

#: The share of the cache a prefetch window of two or more batches may fill (cachedemb.prefetch.windows.FILL).
WINDOW_FILL = 0.5
#: Next-use value of an id that is never used again (fits in int64 even when negated).
INF = np.int64(1 << 62)

# Traces whose ids are non-negative and below this bound (or below twice the number of
# per-batch unique lookups) are indexed directly instead of being compacted with np.unique.
_DIRECT_ID_BOUND = 1 << 22


@dataclass(frozen=True, eq=False)
class SimResult:
    """Outcome of replaying one trace through one policy; counts are per-batch unique ids."""

    policy: str
    capacity: int
    rows_moved: int
    hits: int
    misses: int
    streamed: int
    lookups: int
    unique_lookups: int
    rows_moved_per_batch: np.ndarray
    #: Rows moved of each dense id (``PreparedTrace`` order), when asked for with ``per_id=True``.
    rows_moved_per_id: np.ndarray | None = None

    @property
    def hit_rate(self) -> float:
        """Fraction of per-batch unique ids that were resident before their batch."""
        return self.hits / self.unique_lookups if self.unique_lookups else 0.0


class PreparedTrace:
    """A trace reduced to per-batch sorted unique dense ids and their occurrence counts.

    Why: every simulator needs the same per-batch ``np.unique``; preparing once and passing the
    result to several simulators avoids repeating that work.  Dense ids keep every per-id state
    array as small as the set of distinct ids; dense order equals original id order, so ties
    broken "by id" mean the same thing in both spaces.
    """

    def __init__(self, trace: Sequence[np.ndarray], extra_ids: np.ndarray | None = None):
        """``extra_ids``: ids that must exist in the dense id space though the trace may never use them (a
        warm start's preloaded rows)."""
        if isinstance(trace, np.ndarray) and trace.ndim == 2:
            trace = list(trace)
        uniq, counts = [], []
        lookups = 0
        for t, batch in enumerate(trace):
            b = np.asarray(batch)
            if b.ndim != 1:
                raise ValueError(f"trace batch {t}: expected a 1-D array of ids, got shape {b.shape}")
            if b.size and not np.issubdtype(b.dtype, np.integer):
                raise ValueError(f"trace batch {t}: expected integer ids, got dtype {b.dtype}")
            u, c = np.unique(b.astype(np.int64, copy=False), return_counts=True)
            uniq.append(u)
            counts.append(c.astype(np.int64))
            lookups += b.size
        self._setup(uniq, counts, lookups, extra_ids)

    @classmethod
    def from_unique(cls, uniq: Sequence[np.ndarray], counts: Sequence[np.ndarray],
                    extra_ids: np.ndarray | None = None) -> "PreparedTrace":
        """From per-batch sorted distinct ids and their occurrence counts (what the constructor computes)."""
        self = cls.__new__(cls)
        uniq = [np.asarray(u, dtype=np.int64) for u in uniq]
        counts = [np.asarray(c, dtype=np.int64) for c in counts]
        self._setup(uniq, counts, int(sum(int(c.sum()) for c in counts)), extra_ids)
        return self

    def _setup(self, uniq, counts, lookups, extra_ids) -> None:
        self.lookups = int(lookups)
        self.num_batches = len(uniq)
        self.unique_lookups = int(sum(u.size for u in uniq))
        extra = np.unique(np.asarray(extra_ids if extra_ids is not None else [], dtype=np.int64).ravel())
        nonempty = [u for u in uniq + [extra] if u.size]
        lo = min((int(u[0]) for u in nonempty), default=0)
        hi = max((int(u[-1]) for u in nonempty), default=-1)
        if lo >= 0 and hi < max(_DIRECT_ID_BOUND, 2 * (self.unique_lookups + extra.size)):
            self.values = None  # dense id == original id
            self.num_ids = hi + 1
        else:
            values, inverse = np.unique(np.concatenate(uniq + [extra]), return_inverse=True)
            splits = np.cumsum([u.size for u in uniq])
            uniq = [x.astype(np.int64) for x in np.split(inverse.ravel(), splits)][: len(uniq)]
            self.values = values
            self.num_ids = int(values.size)
        self.uniq = uniq
        self.counts = counts
        self._next_use = None
        self._first_use = None

    def original_ids(self, dense: np.ndarray) -> np.ndarray:
        """Map dense ids back to the trace's own id values."""
        return dense if self.values is None else self.values[dense]

    def dense_ids(self, ids) -> np.ndarray:
        """Map original ids (each in the trace or its ``extra_ids``) to dense ids."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if self.values is None:
            known = (ids >= 0) & (ids < self.num_ids)
        else:
            pos = np.minimum(np.searchsorted(self.values, ids), max(self.num_ids - 1, 0))
            known = (self.values[pos] == ids) if self.num_ids else np.zeros(ids.size, dtype=bool)
            ids = pos
        if not known.all():
            raise ValueError(f"id {int(np.asarray(ids)[~known][0])} is neither in the trace nor in its extra_ids")
        return ids

    def per_dense_id(self, values_by_id, name: str) -> np.ndarray:
        """``values_by_id[original id]`` for every dense id (ids past the array's end get 0)."""
        arr = np.asarray(values_by_id)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must be a 1-D integer array indexed by id, got {arr.dtype} {arr.shape}")
        ids = self.original_ids(np.arange(self.num_ids, dtype=np.int64))
        out = np.zeros(self.num_ids, dtype=np.int64)
        inside = ids < arr.size
        out[inside] = arr[ids[inside]]
        return out

    def _compute_next_use(self) -> None:
        # Walk batches backwards: the next use of every id of batch t is the last batch seen so far.
        seen = np.full(self.num_ids, INF, dtype=np.int64)
        nxt = [None] * self.num_batches
        for t in range(self.num_batches - 1, -1, -1):
            u = self.uniq[t]
            nxt[t] = seen[u]
            seen[u] = t
        self._next_use, self._first_use = nxt, seen

    @property
    def next_use(self) -> list[np.ndarray]:
        """Per batch, aligned with ``uniq[t]``: the next batch index using each id, or ``INF``."""
        if self._next_use is None:
            self._compute_next_use()
        return self._next_use

    @property
    def first_use(self) -> np.ndarray:
        """Per dense id: the first batch using it (``INF`` for dense ids that never occur)."""
        if self._first_use is None:
            self._compute_next_use()
        return self._first_use


def prepare_trace(trace, extra_ids=None) -> PreparedTrace:
    """Return ``trace`` as a :class:`PreparedTrace` (unchanged if it already is one and knows ``extra_ids``)."""
    if isinstance(trace, PreparedTrace):
        if extra_ids is not None and len(extra_ids):
            trace.dense_ids(extra_ids)  # raises if the prepared trace's id space lacks them
        return trace
    return PreparedTrace(trace, extra_ids)


def _check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be a positive integer number of rows, got {capacity!r}")
    return int(capacity)


def _lowest(keys: list[np.ndarray], n: int) -> np.ndarray:
    """Indices of the ``n`` smallest entries under lexicographic order of ``keys`` (primary first).

    The last key must be unique (the id), which makes the choice deterministic.  Partitioning on
    the primary key first keeps the common case linear; only the tie group is lexsorted.
    """
    m = keys[0].size
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    if n >= m:
        return np.arange(m)
    primary = keys[0]
    kth = np.partition(primary, n - 1)[n - 1]
    below = np.flatnonzero(primary < kth)
    tie = np.flatnonzero(primary == kth)
    need = n - below.size
    if need == tie.size:
        return np.concatenate([below, tie])
    order = np.lexsort([k[tie] for k in reversed(keys[1:])])
    return np.concatenate([below, tie[order[:need]]])


class _Policy:
    """Per-id state and eviction priority of one fully associative policy."""

    name = ""

    def __init__(self, prep: PreparedTrace, capacity: int):
        self.prep = prep
        self.capacity = capacity
        self.last = np.full(prep.num_ids, -1, dtype=np.int64)

    def access(self, t: int, u: np.ndarray, cnt: np.ndarray, hit: np.ndarray) -> None:
        self.last[u] = t

    def window(self, t: int) -> np.ndarray:
        """Ids that must be resident for batch ``t`` (sorted, unique)."""
        return self.prep.uniq[t]

    def keys(self, ids: np.ndarray, t: int) -> list[np.ndarray]:
        """Eviction order: lexicographically smallest is evicted first; last key is the id."""
        raise NotImplementedError


class _LRU(_Policy):
    name = "lru"

    def keys(self, ids, t):
        return [self.last[ids], ids]


def _initial_counts(prep: PreparedTrace, initial_counts) -> np.ndarray:
    if initial_counts is None:
        return np.zeros(prep.num_ids, dtype=np.int64)
    counts = prep.per_dense_id(initial_counts, "initial_counts")
    if counts.size and counts.min() < 0:
        raise ValueError(f"initial_counts must be non-negative, found {int(counts.min())}")
    return counts


class _LFU(_Policy):
    name = "lfu"

    def __init__(self, prep, capacity, initial_counts=None):
        super().__init__(prep, capacity)
        self.count = _initial_counts(prep, initial_counts)

    def access(self, t, u, cnt, hit):
        super().access(t, u, cnt, hit)
        self.count[u] += cnt

    def keys(self, ids, t):
        return [self.count[ids], self.last[ids], ids]


class _LFUReset(_LFU):
    name = "lfu_reset"

    def access(self, t, u, cnt, hit):
        self.last[u] = t
        self.count[u[hit]] += cnt[hit]
        self.count[u[~hit]] = cnt[~hit]  # admitted (or streamed) now: count starts afresh


class _OPT(_Policy):
    name = "opt"

    def __init__(self, prep, capacity):
        super().__init__(prep, capacity)
        self.next_use = prep.first_use.copy()

    def access(self, t, u, cnt, hit):
        super().access(t, u, cnt, hit)
        self.next_use[u] = self.prep.next_use[t]

    def keys(self, ids, t):
        return [-self.next_use[ids], ids]


class _Lookahead(_OPT):
    name = "lookahead"

    def __init__(self, prep, capacity, horizon: int, depth: int, initial_counts=None, prefetch: bool = False,
                 overlap: bool = False):
        super().__init__(prep, capacity)
        self.horizon = horizon
        self.depth = depth
        self.count = _initial_counts(prep, initial_counts)
        self.prefetch, self.overlap = prefetch, overlap
        self.window_end = 0
        self.pending = None  # (start, count, union) of a window admitted during the previous one (overlap)

    def access(self, t, u, cnt, hit):
        super().access(t, u, cnt, hit)
        self.count[u] += cnt

    def _union(self, t, count):
        ids = np.sort(np.concatenate(self.prep.uniq[t:t + count]))
        keep = np.ones(ids.size, dtype=bool)
        keep[1:] = ids[1:] != ids[:-1]
        return ids[keep]

    def window(self, t):
        if self.prefetch:
            return self._prefetch_window(t)
        uniq = self.prep.uniq
        p = uniq[t]
        for j in range(1, min(self.depth, len(uniq) - t)):
            q = np.union1d(p, uniq[t + j])
            if q.size > self.capacity:
                break
            p = q
        return p

    def _plan(self, t, remaining):
        """cachedemb.prefetch's window plan at ``t`` (cachedemb/prefetch/windows.py): batches join while the union
        fits, a window of two or more batches in ``WINDOW_FILL`` of the cache; (count, union), count 0 when batch
        ``t`` alone does not fit."""
        union, count = None, 0
        for k in range(min(self.depth, remaining)):
            grown = self.prep.uniq[t] if k == 0 else np.union1d(union, self.prep.uniq[t + k])
            if grown.size > (self.capacity if k == 0 else int(self.capacity * WINDOW_FILL)):
                break
            union, count = grown, k + 1
        return count, union

    def _prefetch_window(self, t):
        """cachedemb.prefetch's windows: at a window start the batches that fit together (`_plan`), kept until the
        window ends (none fits: the batch alone, oversized); with ``overlap`` the next window too, admitted now
        when both unions fit together."""
        if t < self.window_end:
            return self.prep.uniq[t]  # inside a window: its rows are resident
        remaining = len(self.prep.uniq) - t
        if self.pending is not None and self.pending[0] == t:
            _, count, union = self.pending
        else:
            count, union = self._plan(t, remaining)
        self.pending = None
        self.window_end = t + max(count, 1)
        if not count:
            return self.prep.uniq[t]
        if self.overlap and self.window_end < len(self.prep.uniq):
            nxt, nxt_union = self._plan(self.window_end, len(self.prep.uniq) - self.window_end)
            if nxt and union.size + nxt_union.size <= self.capacity:
                self.pending = (self.window_end, nxt, nxt_union)
                return np.union1d(union, nxt_union)
        return union

    def keys(self, ids, t):
        nu = self.next_use[ids]
        warm = nu < t + self.horizon
        return [warm.astype(np.int64), np.where(warm, -nu, 0), self.count[ids], self.last[ids], ids]


def _run(prep: PreparedTrace, policy: _Policy, preload=None, per_id: bool = False) -> SimResult:
    """Replay ``prep`` through a fully associative cache governed by ``policy``, starting with the ``preload``
    ids resident; ``per_id`` also counts each id's rows moved."""
    cap = policy.capacity
    resident = np.zeros(prep.num_ids, dtype=bool)
    stamp = np.full(prep.num_ids, -1, dtype=np.int64)
    res = np.empty(0, dtype=np.int64)
    if preload is not None and len(preload):
        res = np.unique(prep.dense_ids(preload))
        if res.size > cap:
            raise ValueError(f"preload has {res.size} distinct ids, more than the capacity of {cap} rows")
        resident[res] = True
    per_batch = np.zeros(prep.num_batches, dtype=np.int64)
    moved_by_id = np.zeros(prep.num_ids, dtype=np.int64) if per_id else None
    hits = streamed = 0
    for t in range(prep.num_batches):
        u, cnt = prep.uniq[t], prep.counts[t]
        hit = resident[u]
        hits += int(np.count_nonzero(hit))
        policy.access(t, u, cnt, hit)
        p = policy.window(t)
        new = p[~resident[p]]
        per_batch[t] = new.size
        if moved_by_id is not None:
            moved_by_id[new] += 1  # `new` holds each id once
        if p.size <= cap:
            overflow = res.size + new.size - cap
            if overflow > 0:
                stamp[p] = t
                cand = res[stamp[res] != t]
                victims = cand[_lowest(policy.keys(cand, t), overflow)]
                resident[victims] = False
                res = res[resident[res]]
            resident[new] = True
            res = np.concatenate([res, new])
        else:  # oversized batch (the window is then the batch itself)
            drop = _lowest(policy.keys(u, t), u.size - cap)
            keep = np.ones(u.size, dtype=bool)
            keep[drop] = False
            streamed += int(np.count_nonzero(~keep & ~hit))
            resident[res] = False
            res = u[keep]
            resident[res] = True
    misses = prep.unique_lookups - hits
    return SimResult(
        policy=policy.name,
        capacity=cap,
        rows_moved=int(per_batch.sum()),
        hits=hits,
        misses=misses,
        streamed=streamed,
        lookups=prep.lookups,
        unique_lookups=prep.unique_lookups,
        rows_moved_per_batch=per_batch,
        rows_moved_per_id=moved_by_id,
    )


def _prepare(trace, preload) -> PreparedTrace:
    return prepare_trace(trace, None if preload is None else np.asarray(preload, dtype=np.int64).ravel())


def simulate_lru(trace, capacity: int, *, preload=None, per_id: bool = False) -> SimResult:
    """Least-recently-used: evict the resident id whose last batch is oldest, ties by lower id."""
    prep = _prepare(trace, preload)
    return _run(prep, _LRU(prep, _check_capacity(capacity)), preload, per_id)


def simulate_lfu(trace, capacity: int, *, initial_counts=None, preload=None, per_id: bool = False) -> SimResult:
    """LFU with persistent counts: each id's count is its total occurrences so far (surviving
    evictions; ``initial_counts[id]`` before the trace); evict the lowest count, ties by older last use,
    then lower id."""
    prep = _prepare(trace, preload)
    return _run(prep, _LFU(prep, _check_capacity(capacity), initial_counts), preload, per_id)


def simulate_lfu_reset(trace, capacity: int, *, preload=None, per_id: bool = False) -> SimResult:
    """LFU whose counts restart on admission (ColossalAI's cache): a missed id's count becomes
    its occurrences in the admitting batch, evicted ids forget it; ties as in :func:`simulate_lfu`."""
    prep = _prepare(trace, preload)
    return _run(prep, _LFUReset(prep, _check_capacity(capacity)), preload, per_id)


def simulate_opt(trace, capacity: int, *, preload=None, per_id: bool = False) -> SimResult:
    """Belady-OPT at batch granularity: evict ids never used again first, then the ones whose
    next batch is furthest away (ties by lower id).  The floor on rows moved for demand caching."""
    prep = _prepare(trace, preload)
    return _run(prep, _OPT(prep, _check_capacity(capacity)), preload, per_id)


def simulate_lookahead(trace, capacity: int, horizon: int, depth: int = 1, *, initial_counts=None,
                       preload=None, per_id: bool = False, prefetch: bool = False,
                       overlap: bool = False) -> SimResult:
    """Policy that sees ``horizon`` batches ahead and prefetches ``depth`` batches at once.

    At batch ``t`` the rows of batches ``t..t+k-1`` are made resident together (``k <= depth``,
    the largest whose union fits; ``k = 1`` when even that does not) and are never evicted.
    Among other resident rows, those unused in batches ``t..t+horizon-1`` go first, least
    frequently used first (counts and ties as in :func:`simulate_lfu`); then the rows whose next
    use is furthest away.  Prefetched rows count as rows moved in the batch that loads them.

    ``prefetch=True`` replays `cachedemb.prefetch`'s windows instead of a window sliding every batch: at a
    window start ``s`` the union of batches ``s..s+k-1`` is admitted (``k <= depth``: batches join while the union
    fits, in half the cache for two or more; 0: batch ``s`` alone, oversized) and protected until ``s+k``, where
    the next window starts (1 for k = 0); ``overlap=True`` (cachedemb.prefetch's default) also admits the next window at ``s``
    when both unions fit together.
    With ``depth=1`` both modes are the same.
    """
    for name, v in (("horizon", horizon), ("depth", depth)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive number of batches, got {v!r}")
    prep = _prepare(trace, preload)
    return _run(prep, _Lookahead(prep, _check_capacity(capacity), int(horizon), int(depth), initial_counts,
                                 bool(prefetch), bool(overlap)), preload, per_id)


def murmur3_fmix64(ids) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer on int64 ids (as uint64, wrapping), FBGEMM's ``cache_slot`` mix."""
    h = np.asarray(ids).astype(np.int64).view(np.uint64).copy()
    with np.errstate(over="ignore"):
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xC4CEB9FE1A85EC53)
        h ^= h >> np.uint64(33)
    return h


def simulate_set_lru(trace, capacity: int, ways: int = 32) -> SimResult:
    """Set-associative LRU laid out like FBGEMM's cache.

    ``ways = min(ways, capacity)`` and ``num_sets = capacity // ways`` (so ``num_sets * ways``
    rows are usable); an id lives in set ``murmur3_fmix64(id) % num_sets`` and each set is an
    LRU of ``ways`` slots (ties by lower id).  If a batch maps more ids to one set than it has
    ways, that set keeps the ``ways`` highest-ranked batch ids (the largest ids, all being
    equally recent) and streams the other misses, counted in ``streamed``.
    """
    capacity = _check_capacity(capacity)
    if isinstance(ways, bool) or not isinstance(ways, (int, np.integer)) or ways < 1:
        raise ValueError(f"ways must be a positive integer, got {ways!r}")
    prep = prepare_trace(trace)
    ways = min(int(ways), capacity)
    num_sets = capacity // ways
    dense = np.arange(prep.num_ids, dtype=np.int64)
    set_of = (murmur3_fmix64(prep.original_ids(dense)) % np.uint64(num_sets)).astype(np.int64)
    table = np.full((num_sets, ways), -1, dtype=np.int64)
    resident = np.zeros(prep.num_ids, dtype=bool)
    last = np.full(prep.num_ids, -1, dtype=np.int64)
    per_batch = np.zeros(prep.num_batches, dtype=np.int64)
    span_t, span_id = prep.num_batches + 1, max(prep.num_ids, 1)
    fused = num_sets * span_t * span_id < 1 << 62
    hits = streamed = 0
    for t in range(prep.num_batches):
        u = prep.uniq[t]
        hit = resident[u]
        hits += int(np.count_nonzero(hit))
        last[u] = t
        miss = u[~hit]
        per_batch[t] = miss.size
        if not miss.size:
            continue
        sets, row_of_miss = np.unique(set_of[miss], return_inverse=True)
        block = table[sets]
        occupied = block >= 0
        cand = np.concatenate([block[occupied], miss])
        row = np.concatenate([np.nonzero(occupied)[0], row_of_miss.ravel()])
        # Within each set keep the most recent first, then the larger id.
        if fused:  # one int64 key sorts faster than a three-key lexsort
            order = np.argsort((row * span_t + (t - last[cand])) * span_id + (span_id - 1 - cand))
        else:
            order = np.lexsort((-cand, -last[cand], row))
        cand, row = cand[order], row[order]
        rank = np.arange(cand.size) - np.searchsorted(row, row)
        keep = rank < ways
        was_resident = resident[cand]
        streamed += int(np.count_nonzero(~keep & ~was_resident))
        resident[cand] = keep
        new_block = np.full_like(block, -1)
        new_block[row[keep], rank[keep]] = cand[keep]
        table[sets] = new_block
    return SimResult(
        policy="set_lru",
        capacity=capacity,
        rows_moved=int(per_batch.sum()),
        hits=hits,
        misses=prep.unique_lookups - hits,
        streamed=streamed,
        lookups=prep.lookups,
        unique_lookups=prep.unique_lookups,
        rows_moved_per_batch=per_batch,
    )


#: Simulators by name, for benchmarks that sweep policies.
POLICIES: dict[str, Callable[..., SimResult]] = {
    "lru": simulate_lru,
    "lfu": simulate_lfu,
    "lfu_reset": simulate_lfu_reset,
    "set_lru": simulate_set_lru,
    "lookahead": simulate_lookahead,
    "opt": simulate_opt,
}


def simulate(policy: str, trace, capacity: int, **kwargs) -> SimResult:
    """Run the simulator registered as ``policy`` in :data:`POLICIES`."""
    try:
        fn = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)}") from None
    return fn(trace, capacity, **kwargs)
