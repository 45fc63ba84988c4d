"""The look-ahead pipeline: `cachedemb.prefetch(batches, modules, depth, horizon)` reads ids ahead and admits each
window's rows in one batched transfer, overlapped with compute where the cache holds both windows.

Its stages, threads, streams and the hazards each rules out: docs/prefetch.md.

Modules: `pipeline` (Prefetcher, prefetch: the training thread's side), `overlap` (its overlap decisions and copy
rule as plain logic), `ids_check` (whether each forward looked up the ids read ahead for it), `read_ahead` (the
thread), `next_use` (NextUseTracker), `id_map` (the host hash map under it), `host_map` (their per-id loops in C),
`windows` (window depth and union).
May import: cachedemb.cache, cachedemb.kernels (the torch reference of unique_ids) and torch; nothing imports it but
the facade and cachedemb.distributed.
"""
from cachedemb.prefetch.ids_check import PrefetchIdsWarning
from cachedemb.prefetch.next_use import NextUseTracker
from cachedemb.prefetch.pipeline import Prefetcher, prefetch

__all__ = ["NextUseTracker", "PrefetchIdsWarning", "Prefetcher", "prefetch"]
