"""Cache sizing before training: miss-ratio curves from id traces, and a device-memory budget split over tables.

Owns the offline side of the cache, nothing on the hot path: the batch-granular policy simulators (`simulators`:
lfu, lru, the look-ahead policy, Belady-OPT, peers' policies).

May import: numpy, torch, `cachedemb.optim` (per-row optimizer state sizes). Nothing of the cache, the modules or
the kernels: the collection imports this package (`cache_rows="auto"`), so it sits below it.
"""
