"""Miss-ratio curves: rows moved host->device per batch against cache rows, for one table and one policy.

The cache model is the simulators' (`cachedemb.sizing.simulators`): batch-granular, a batch's distinct ids
resident together, a miss moves one row; the look-ahead policy replays `cachedemb.prefetch`'s windows (the
union of up to ``depth`` batches admitted at each window start, ``overlap`` as `cachedemb.prefetch` does by default). The miss ratio is rows moved ÷ per-batch distinct ids (1 - the module's `hit_rate`).

How each curve is computed:

- ``lru`` without a warm start: exact at every size from one pass (`stack_distance`); the curve lists the grid.
- ``lfu``, ``opt``, ``lookahead`` (and ``lru`` with preloaded rows): one simulation per grid size; each point is
  exactly what the simulator gives there (between points the curve is drawn straight).
- A sampled trace (``sample_rate`` < 1, or a `TableTrace` read with sampling): SHARDS. A cache of C rows is
  simulated as one of round(C·R) rows over the sample (LRU: ranks compared with C·R), and the full trace's rows
  moved are estimated from the kept ids' with the regression estimator (`_Estimator`), which stays accurate when
  a few hot ids carry much of the trace; the standard error of each point is estimated from ``error_bands``
  disjoint sub-samples of the sample (the spread of their curves ÷ sqrt of their number).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from cachedemb.sizing import simulators
from cachedemb.sizing.shards import TableTrace, table_trace
from cachedemb.sizing.stack_distance import lru_stack_distances

POLICIES = ("lfu", "lru", "lookahead", "opt")


@dataclass(frozen=True)
class WarmStart:
    """The module's warm start from `id_freq`: counts seed LFU (and the look-ahead policy's counts), and the
    ``int(ratio * cache rows)`` ids with the highest counts are resident before the first batch (torch.topk,
    as the module picks them)."""

    counts: np.ndarray
    ratio: float = 0.7

    def __post_init__(self):
        counts = np.asarray(self.counts)
        if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer) or (counts.size and counts.min() < 0):
            raise ValueError(f"warm-start counts must be a 1-D array of non-negative integers, got {counts.dtype} "
                             f"shape {counts.shape}")
        if not 0 <= float(self.ratio) <= 1:
            raise ValueError(f"warmup ratio must be in [0, 1], got {self.ratio!r}")
        object.__setattr__(self, "counts", np.array(counts, dtype=np.int64))  # owned and writable (torch.topk)

    def hottest(self, k: int) -> np.ndarray:
        """The k ids the module preloads (ascending)."""
        k = min(int(k), self.counts.size)
        if k <= 0:
            return np.empty(0, dtype=np.int64)
        idx = torch.topk(torch.from_numpy(self.counts), k, sorted=True).indices
        return np.sort(idx.numpy())

    def preload_rows(self, capacity: int) -> int:
        return min(int(self.ratio * capacity), self.counts.size)


@dataclass(frozen=True)
class MissRatioCurve:
    """Rows moved over the trace at each of ``sizes`` cache rows (ascending, from 0); exact, or SHARDS
    estimates with a standard error per point."""

    policy: str
    sizes: np.ndarray  # int64 cache rows
    rows_moved: np.ndarray  # float64 rows moved host->device over the whole trace
    num_batches: int
    unique_lookups: int  # per-batch distinct ids summed over the batches: the miss ratio's denominator
    lookups: int
    distinct_ids: int  # distinct ids of the trace (estimated from a sample)
    sample_rate: float = 1.0
    stderr: np.ndarray | None = None  # of the miss ratio at each size; None for an exact curve
    method: str = "simulation"  # "stack" (one pass) or "simulation" (one per size); "shards-" + it when sampled
    options: dict = field(default_factory=dict)  # horizon, depth, warm start

    @property
    def miss_ratio(self) -> np.ndarray:
        return self.rows_moved / max(self.unique_lookups, 1)

    @property
    def rows_per_batch(self) -> np.ndarray:
        return self.rows_moved / max(self.num_batches, 1)

    @property
    def unique_per_batch(self) -> float:
        """Mean distinct ids per batch (torchrec's `expected_lookups`)."""
        return self.unique_lookups / max(self.num_batches, 1)

    @property
    def max_stderr(self) -> float:
        return float(self.stderr.max()) if self.stderr is not None and self.stderr.size else 0.0

    def miss_ratio_at(self, rows) -> np.ndarray | float:
        """The miss ratio at any cache size: exact at the curve's sizes, straight between them, flat past the
        last (every distinct id fits there)."""
        out = np.interp(np.asarray(rows, dtype=np.float64), self.sizes, self.miss_ratio)
        return float(out) if np.ndim(rows) == 0 else out

    def rows_per_batch_at(self, rows) -> np.ndarray | float:
        out = np.asarray(self.miss_ratio_at(rows)) * self.unique_per_batch
        return float(out) if np.ndim(rows) == 0 else out

    def to_dict(self) -> dict:
        return {"policy": self.policy, "method": self.method, "sample_rate": self.sample_rate,
                "num_batches": self.num_batches, "lookups": self.lookups, "unique_lookups": self.unique_lookups,
                "distinct_ids": self.distinct_ids, "options": dict(self.options),
                "sizes": self.sizes.tolist(), "miss_ratio": [round(float(v), 6) for v in self.miss_ratio],
                "rows_per_batch": [round(float(v), 3) for v in self.rows_per_batch],
                "stderr": None if self.stderr is None else [round(float(v), 6) for v in self.stderr]}


def default_sizes(distinct_ids: int, points: int = 32, num_rows: int | None = None) -> np.ndarray:
    """0, then ``points`` sizes spaced evenly in log scale from 1 row to the trace's distinct ids (capped at the
    table's rows), where every id fits and the curve goes flat."""
    if isinstance(points, bool) or not isinstance(points, (int, np.integer)) or points < 2:
        raise ValueError(f"points must be an integer >= 2, got {points!r}")
    top = max(1, int(distinct_ids) if num_rows is None else min(int(distinct_ids), int(num_rows)))
    grid = np.unique(np.round(np.geomspace(1, top, int(points))).astype(np.int64))
    return np.concatenate([[0], grid]).astype(np.int64)


def _check_sizes(sizes) -> np.ndarray:
    arr = np.asarray(sizes)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0:
        raise ValueError(f"sizes must be a non-empty 1-D array of cache rows >= 0, got {sizes!r}")
    return np.unique(arr.astype(np.int64))


def _check_policy(policy: str, horizon, depth, overlap) -> dict:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: expected one of {POLICIES}")
    if policy != "lookahead":
        return {}
    for name, v in (("horizon", horizon), ("depth", depth)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive number of batches, got {v!r}")
    if horizon < depth:
        raise ValueError(f"horizon must be >= depth={depth} (cachedemb.prefetch reads the window ahead), got {horizon}")
    return {"horizon": int(horizon), "depth": int(depth), "overlap": bool(overlap)}


class _Estimator:
    """Rows moved over the full trace ÷ its per-batch distinct ids, from the kept ids' rows moved y and batches x.

    Exact trace: sum(y) / sum(x). Sample at rate R: the regression estimator of sampling theory,
    sum(y)/R + b (X - sum(x)/R), with X the full trace's per-batch distinct ids (counted exactly while reading)
    and b the least-squares slope of y on x over the kept ids. A hot id (in most batches) swings the plain
    estimators: sum(y)/R at caches too small to hold it (y = x there: b = 1 recovers X exactly), sum(y)/sum(x)·X
    at caches large enough that only first uses miss (y = 1 there: b = 0 leaves the low-variance count of ids).
    Takes sum(y) and sum(x·y) only, so a whole curve's sums can come from one sorted pass.
    """

    def __init__(self, trace: TableTrace, batches_of_id: np.ndarray):
        self.total, self.rate, self.exact = trace.unique_lookups, trace.rate, trace.exact
        x = batches_of_id[batches_of_id > 0].astype(np.float64)
        self.n, self.sx, self.sxx = x.size, float(x.sum()), float(x @ x)

    def __call__(self, sum_y: float, sum_xy: float) -> float:
        if not self.total:
            return 1.0
        if self.exact:
            return sum_y / self.total
        slope = 0.0
        var = self.sxx - self.sx * self.sx / self.n if self.n > 1 else 0.0
        if var > 1e-9 * max(self.sxx, 1.0):
            slope = (sum_xy - self.sx * sum_y / self.n) / var
        return max(0.0, (sum_y / self.rate + slope * (self.total - self.sx / self.rate)) / self.total)


def _ratios(trace: TableTrace, policy: str, sizes: np.ndarray, options: dict, warm: WarmStart | None) -> tuple:
    """Miss ratio of ``trace`` (a sample at its rate R, or exact) at cache sizes ``sizes`` of the full trace,
    and the method used."""
    rate = trace.rate
    out = np.ones(sizes.size, dtype=np.float64)  # a cache of 0 rows moves every distinct id
    live = np.flatnonzero(sizes > 0)
    if policy == "lru" and warm is None:
        prep = trace.prepared()
        if prep.unique_lookups:
            ids = np.concatenate(prep.uniq)
            batches_of_id = np.bincount(ids, minlength=prep.num_ids)
            estimate = _Estimator(trace, batches_of_id)
            # An access moves a row at C rows iff its rank > C·R: sums over the accesses ranked above each size.
            distances = lru_stack_distances(prep)
            order = np.argsort(distances, kind="stable")
            ranked = distances[order]
            tail_y = np.concatenate([np.cumsum(np.ones(ranked.size)[::-1])[::-1], [0.0]])
            tail_xy = np.concatenate([np.cumsum(batches_of_id[ids[order]][::-1].astype(np.float64))[::-1], [0.0]])
            for i in live:
                k = int(np.searchsorted(ranked, np.floor(sizes[i] * rate), side="right"))
                out[i] = estimate(tail_y[k], tail_xy[k])
        return out, "stack"
    scaled = np.maximum(1, np.round(sizes * rate)).astype(np.int64)
    preloads: dict[int, np.ndarray] = {}
    extra = None
    if warm is not None:
        for c, s in zip(sizes[live], scaled[live]):
            ids = warm.hottest(warm.preload_rows(int(c)))
            if not trace.exact:
                ids = ids[trace.keeps(ids)]
            preloads[int(c)] = ids[np.argsort(-warm.counts[ids], kind="stable")][: int(s)]
        extra = np.unique(np.concatenate([np.empty(0, dtype=np.int64)] + list(preloads.values())))
    prep = trace.prepared(extra)
    if not prep.unique_lookups:
        return out, "simulation"
    batches_of_id = np.bincount(np.concatenate(prep.uniq), minlength=prep.num_ids)
    estimate = _Estimator(trace, batches_of_id)
    for i in live:
        kw = dict(options, prefetch=True) if policy == "lookahead" else dict(options)
        if warm is not None:
            kw["preload"] = preloads[int(sizes[i])]
            if policy in ("lfu", "lookahead"):
                kw["initial_counts"] = warm.counts
        result = simulators.simulate(policy, prep, int(scaled[i]), per_id=True, **kw)
        y = result.rows_moved_per_id
        out[i] = estimate(float(y.sum()), float(y @ batches_of_id))
    return out, "simulation"


def miss_ratio_curve(trace, policy: str = "lfu", sizes=None, *, horizon: int = 64, depth: int = 4,
                     overlap: bool = True, num_rows: int | None = None, warm_start: WarmStart | None = None, sample_rate: float = 1.0,
                     max_unique: int | None = None, salt: int = 0, error_bands: int = 4,
                     points: int = 32) -> MissRatioCurve:
    """The miss-ratio curve of one table's ``trace`` under ``policy`` (``"lfu"``, ``"lru"``, ``"lookahead"``:
    `cachedemb.prefetch`'s windows with its ``horizon``, ``depth`` and ``overlap``, or ``"opt"``, Belady's floor).

    ``trace``: batches of ids (1-D arrays, or a 2-D array one row per batch) or a `TableTrace` (possibly
    sampled while it was read). ``sample_rate`` < 1 or ``max_unique`` (a bound on the kept per-batch
    distinct ids) sample it here (SHARDS), with
    ``error_bands`` sub-samples estimating the error (0: none). ``sizes``: cache rows to evaluate (default:
    `default_sizes` with ``points`` sizes up to the distinct ids, capped at ``num_rows``). ``warm_start``: the
    module's `id_freq` warm start (`WarmStart`).
    """
    options = _check_policy(policy, horizon, depth, overlap)
    if warm_start is not None and not isinstance(warm_start, WarmStart):
        raise ValueError(f"warm_start must be a cachedemb.sizing.WarmStart or None, got {type(warm_start).__name__}")
    if isinstance(error_bands, bool) or not isinstance(error_bands, (int, np.integer)) or error_bands < 0 \
            or error_bands == 1:
        raise ValueError(f"error_bands must be 0 (no error estimate) or an integer >= 2, got {error_bands!r}")
    tt = table_trace(trace, sample_rate, max_unique, salt)
    kept = tt.kept_ids()
    distinct = int(round(kept.size / tt.rate)) if not tt.exact else int(kept.size)
    if num_rows is not None and kept.size and (kept.min() < 0 or kept.max() >= num_rows):
        bad = int(kept.min()) if kept.min() < 0 else int(kept.max())
        raise ValueError(f"id {bad} is outside the table's [0, {num_rows}) rows")
    sizes = default_sizes(distinct, points, num_rows) if sizes is None else _check_sizes(sizes)
    ratios, method = _ratios(tt, policy, sizes, options, warm_start)
    stderr = None
    if not tt.exact and error_bands:
        bands = [_ratios(b, policy, sizes, options, warm_start)[0] for b in tt.split_bands(int(error_bands))]
        stderr = np.std(np.stack(bands), axis=0, ddof=1) / math.sqrt(len(bands))
    if warm_start is not None:
        options = {**options, "warmup_ratio": warm_start.ratio}
    return MissRatioCurve(policy=policy, sizes=sizes, rows_moved=ratios * tt.unique_lookups,
                          num_batches=tt.num_batches, unique_lookups=tt.unique_lookups, lookups=tt.lookups,
                          distinct_ids=distinct, sample_rate=tt.rate, stderr=stderr,
                          method=method if tt.exact else f"shards-{method}", options=options)


__all__ = ["MissRatioCurve", "POLICIES", "WarmStart", "default_sizes", "miss_ratio_curve"]
