"""One table's id trace as the sizing tool keeps it: every id, or a spatially hashed sample of them (SHARDS).

Why: a miss-ratio curve of a trace of billions of ids is too slow to simulate whole. SHARDS (Waldspurger et al.,
"Efficient MRC Construction with SHARDS", FAST '15) keeps only the ids whose hash falls under a threshold, i.e. a
fixed fraction R of the id *space*: every access of a kept id is kept, so each kept id's reuse pattern is intact,
and a cache of C·R rows over the sample behaves like a cache of C rows over the whole trace. The miss ratio is
estimated as sampled misses ÷ sampled per-batch distinct ids (a ratio estimator: it absorbs the difference
between the expected and the actual sample size, as SHARDS_adj does), and rows moved as that ratio × the full
trace's per-batch distinct ids, which are counted exactly while the trace is read.

Each batch is kept as its distinct ids and their counts (what the simulators work on), so a table's memory and
simulation time follow its per-batch distinct ids, not its lookups. The rate is fixed (``rate=``) or adapts to a
bound on the kept per-batch distinct ids (``max_unique``, as the fixed-size SHARDS variant bounds its sample):
when the sample outgrows it the threshold halves and the kept batches are filtered again, so the final sample is
exactly the one the final rate would have kept from the start. A small table stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachedemb.sizing.simulators import PreparedTrace, murmur3_fmix64

#: Hash bits compared with the threshold: rates are multiples of 2^-24.
HASH_BITS = 24
_SCALE = 1 << HASH_BITS
_SALT_MIX = np.uint64(0x9E3779B97F4A7C15)


def spatial_hash(ids, salt: int = 0) -> np.ndarray:
    """The top HASH_BITS bits of MurmurHash3's finalizer of (id xor a salt-derived constant), as int64."""
    ids = np.asarray(ids, dtype=np.int64).ravel()
    with np.errstate(over="ignore"):
        key = ids.view(np.uint64) ^ (np.uint64(int(salt) & ((1 << 64) - 1)) * _SALT_MIX)
    return (murmur3_fmix64(key.view(np.int64)) >> np.uint64(64 - HASH_BITS)).astype(np.int64)


def threshold_of(rate: float) -> int:
    """The hash threshold that keeps a fraction ``rate`` of the id space (at least 1 of 2^24)."""
    rate = float(rate)
    if not 0 < rate <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {rate!r}")
    return max(1, min(_SCALE, int(round(rate * _SCALE))))


@dataclass
class TableTrace:
    """One table's trace: per batch its kept distinct ids (sorted) with their occurrence counts (frequency
    policies count occurrences), each full batch's distinct-id count, and the sample's hash band: ids with
    ``lo <= spatial_hash(id, salt) < hi`` are kept (``lo=0, hi=2^24``: every id, an exact trace)."""

    uniq: list[np.ndarray]
    counts: list[np.ndarray]
    unique_per_batch: np.ndarray  # int64 [num_batches]: distinct ids of each full batch
    lookups: int  # ids of the full trace
    salt: int = 0
    lo: int = 0
    hi: int = _SCALE
    starts: np.ndarray | None = None  # merged tables (`merge`): each table's first id; ids hash as table-local

    @property
    def rate(self) -> float:
        return (self.hi - self.lo) / _SCALE

    @property
    def exact(self) -> bool:
        return self.lo == 0 and self.hi == _SCALE

    @property
    def num_batches(self) -> int:
        return len(self.uniq)

    @property
    def unique_lookups(self) -> int:
        """Per-batch distinct ids of the full trace, summed."""
        return int(self.unique_per_batch.sum())

    @property
    def kept_unique_lookups(self) -> int:
        return int(sum(u.size for u in self.uniq))

    def keeps(self, ids) -> np.ndarray:
        """Which of ``ids`` the sample's band holds (every access of them is in the trace)."""
        h = self._hash(ids)
        return (h >= self.lo) & (h < self.hi)

    def _hash(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if self.starts is not None:
            ids = ids - self.starts[np.searchsorted(self.starts, ids, side="right") - 1]
        return spatial_hash(ids, self.salt)

    def prepared(self, extra_ids=None) -> PreparedTrace:
        """The kept ids as the simulators take them."""
        return PreparedTrace.from_unique(self.uniq, self.counts, extra_ids)

    def band(self, lo: int, hi: int) -> "TableTrace":
        """The sub-sample of ids whose hash is in [lo, hi) (inside this trace's band)."""
        if not self.lo <= lo < hi <= self.hi:
            raise ValueError(f"band [{lo}, {hi}) is not inside this trace's [{self.lo}, {self.hi})")
        uniq, counts = [], []
        for u, c in zip(self.uniq, self.counts):
            h = self._hash(u)
            keep = (h >= lo) & (h < hi)
            uniq.append(u[keep]), counts.append(c[keep])
        return TableTrace(uniq, counts, self.unique_per_batch, self.lookups, self.salt, lo, hi, self.starts)

    def split_bands(self, count: int) -> list["TableTrace"]:
        """``count`` disjoint sub-samples of about equal rate covering this trace's band."""
        edges = [self.lo + (self.hi - self.lo) * j // count for j in range(count + 1)]
        return [self.band(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]

    def kept_ids(self) -> np.ndarray:
        """The distinct kept ids."""
        return np.unique(np.concatenate(self.uniq)) if self.uniq else np.empty(0, dtype=np.int64)


def merge(traces: list[TableTrace], starts) -> TableTrace:
    """Tables that share one cache as a single trace: table k's ids shifted by ``starts[k]`` (ascending, as a
    collection group lays its tables out), every table sampled at the lowest of their rates (each by its own
    table-local ids, so the merged sample is the union of the tables' samples at that rate)."""
    starts = np.asarray(starts, dtype=np.int64)
    if len(traces) != starts.size or not len(traces):
        raise ValueError(f"one start per trace: {len(traces)} traces, {starts.size} starts")
    if np.any(np.diff(starts) <= 0):
        raise ValueError(f"table starts must ascend, got {starts.tolist()}")
    if len({t.num_batches for t in traces}) > 1 or len({t.salt for t in traces}) > 1 or \
            any(t.lo != 0 or t.starts is not None for t in traces):
        raise ValueError("merged traces must be single-table traces of the same batches and salt")
    hi = min(t.hi for t in traces)
    traces = [t if t.hi == hi else t.band(0, hi) for t in traces]
    uniq = [np.concatenate([t.uniq[j] + s for t, s in zip(traces, starts)]) for j in range(traces[0].num_batches)]
    counts = [np.concatenate([t.counts[j] for t in traces]) for j in range(traces[0].num_batches)]
    return TableTrace(uniq, counts, sum(t.unique_per_batch for t in traces), sum(t.lookups for t in traces),
                      traces[0].salt, 0, hi, starts)


class TraceBuilder:
    """Collects one table's batches, keeping all ids or a spatial sample: a fixed ``rate``, halved whenever
    the kept per-batch distinct ids pass ``max_unique``."""

    def __init__(self, rate: float = 1.0, max_unique: int | None = None, salt: int = 0):
        self.threshold = threshold_of(rate)
        if max_unique is not None and (isinstance(max_unique, bool) or int(max_unique) < 1):
            raise ValueError(f"max_unique must be a positive number of ids or None, got {max_unique!r}")
        self.max_unique = None if max_unique is None else int(max_unique)
        self.salt = int(salt)
        self.uniq: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        self.unique: list[int] = []
        self.lookups = 0
        self.kept = 0

    def add(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
        u, c = np.unique(ids.astype(np.int64, copy=False).ravel(), return_counts=True)
        self.lookups += ids.size
        self.unique.append(u.size)
        if self.threshold < _SCALE:
            keep = spatial_hash(u, self.salt) < self.threshold
            u, c = u[keep], c[keep]
        self.uniq.append(u)
        self.counts.append(c.astype(np.int64))
        self.kept += u.size
        while self.max_unique is not None and self.kept > self.max_unique and self.threshold > 1:
            self.threshold //= 2
            keeps = [spatial_hash(u, self.salt) < self.threshold for u in self.uniq]
            self.uniq = [u[k] for u, k in zip(self.uniq, keeps)]
            self.counts = [c[k] for c, k in zip(self.counts, keeps)]
            self.kept = sum(u.size for u in self.uniq)

    def build(self) -> TableTrace:
        return TableTrace(self.uniq, self.counts, np.asarray(self.unique, dtype=np.int64), self.lookups, self.salt,
                          0, self.threshold)


def table_trace(batches, rate: float = 1.0, max_unique: int | None = None, salt: int = 0) -> TableTrace:
    """A TableTrace of ``batches`` (1-D id arrays, or a 2-D array one row per batch), sampled at ``rate`` (and
    under ``max_unique`` kept per-batch distinct ids, if given). A TableTrace is returned as it is when no
    sampling is asked, and sampled further (inside its band) otherwise."""
    if isinstance(batches, TableTrace):
        t = batches
        if rate >= 1 and (max_unique is None or t.kept_unique_lookups <= max_unique):
            return t
        hi = t.lo + threshold_of(rate) * (t.hi - t.lo) // _SCALE if rate < 1 else t.hi
        out = t.band(t.lo, max(hi, t.lo + 1))
        while max_unique is not None and out.kept_unique_lookups > max_unique and out.hi - out.lo > 1:
            out = out.band(out.lo, out.lo + (out.hi - out.lo) // 2)
        return out
    builder = TraceBuilder(rate, max_unique, salt)
    for t, b in enumerate(list(batches) if not isinstance(batches, np.ndarray) or batches.ndim != 2 else batches):
        b = np.asarray(b)
        if b.ndim != 1:
            raise ValueError(f"trace batch {t}: expected a 1-D array of ids, got shape {b.shape}")
        builder.add(b)
    return builder.build()


__all__ = ["HASH_BITS", "TableTrace", "TraceBuilder", "merge", "spatial_hash", "table_trace", "threshold_of"]
