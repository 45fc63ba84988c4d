"""What `cache_stats()` reports beyond the cache's own counters: sums over several caches (a collection's
groups, a rank's shards) and the once-per-module warning that a batch did not fit in the cache."""
from __future__ import annotations

import math
import warnings

from cachedemb.cache.counters import hit_rate
from cachedemb.cache.sync_mode import counts_on_host
from cachedemb.modules.errors import CacheTooSmallWarning


def sum_stats(parts: list[dict]) -> dict:
    """`cache_stats()` dicts summed key by key, nested dicts (`seconds`, `host_cache`, `file`) too; rates are
    recomputed from the sums (`hit_rate` = hits / unique, or hits / (hits + misses) where there is no unique),
    flags (`file.log`) are true if any part's is."""
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                total.setdefault(key, []).append(value)
            elif isinstance(value, bool):
                total[key] = total.get(key, False) or value
            elif key != "hit_rate":
                total[key] = total.get(key, 0) + value
    for key, value in total.items():
        if isinstance(value, list):
            total[key] = sum_stats(value)
    if any("hit_rate" in part for part in parts):
        total["hit_rate"] = rate_of(total)
    return total


def flat_seconds(seconds: dict, prefix: str = "") -> dict[str, float]:
    """`cache_stats()["seconds"]` with its nesting spelled in the keys ("prefetch.read_ahead.unique"), for
    tables and JSON rows."""
    flat: dict[str, float] = {}
    for name, value in seconds.items():
        if isinstance(value, dict):
            flat.update(flat_seconds(value, f"{prefix}{name}."))
        else:
            flat[prefix + name] = value
    return flat


def rate_of(stats: dict) -> float:
    """hit_rate of summed counters: hits / unique (a device cache), else hits / (hits + misses) (a host cache)."""
    if "unique" in stats:
        return hit_rate(stats["hits"], stats["unique"])
    return hit_rate(stats["hits"], stats["hits"] + stats["misses"])


def ratio_holding(distinct: int, num_rows: int) -> float:
    """The cache_ratio, rounded up to two significant digits, whose cache holds `distinct` rows."""
    exact = min(1.0, distinct / num_rows)
    step = 10.0 ** (math.floor(math.log10(exact)) - 1)
    return min(1.0, float(f"{math.ceil(round(exact / step, 9)) * step:.2g}"))


def warn_if_too_small(module, plan, stacklevel: int = 5) -> None:
    """Warn once per module when a batch's distinct ids exceed the cache rows. Where counts are on the host the
    batch's own count is read (free there); under the CUDA rules the largest count that already reached the
    host without a sync (a batch or two late; `cache_stats()` checks again)."""
    cache = module.cache
    if counts_on_host(cache.device):
        distinct = int(plan.n_uniq) if plan is not None else 0
    else:
        distinct = cache.distinct_peak()
    if distinct <= cache.capacity:
        return
    module._warned_small_cache = True
    rows = getattr(module, "_ratio_rows", module.num_embeddings)  # a table on file: its rows, not the slab's
    warnings.warn(
        f"{getattr(module, '_warn_as', type(module).__name__)}: a batch looked up {distinct} distinct ids, more than the {cache.capacity} rows "
        f"of the device cache, so at least {distinct - cache.capacity} of its rows were served from the host "
        f"table (exact, but slower). cache_rows={distinct} (cache_ratio={ratio_holding(distinct, rows):g} of "
        f"{rows} rows) holds such a batch; with prefetch, windows of several batches want about twice that.",
        CacheTooSmallWarning, stacklevel=stacklevel)
