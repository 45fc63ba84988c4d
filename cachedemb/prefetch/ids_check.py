"""Whether each forward looked up the ids the pipeline read ahead for it, checked at O(1) per batch.

The caches count, as they place an announced forward, the lookups that were not read ahead (misses inside an
admitted window, a hand-off whose ids differed: comparisons they make anyway). Where counts live on the host the
count is read after each batch; under the CUDA rules the last in-window forward's miss count (a view, no launch)
is copied to pinned memory at the next window start without blocking and read once landed (`MissEstimate`), so
the check never waits for the device and adds no launch to a step; every count is read at the loop's end.
"""
from __future__ import annotations

import warnings
from typing import Sequence

from cachedemb.cache.embedding_cache import EmbeddingCache
from cachedemb.cache.miss_estimate import MissEstimate
from cachedemb.cache.sync_mode import counts_on_host


class PrefetchIdsWarning(UserWarning):
    """A forward inside `cachedemb.prefetch` looked up other ids than the ones read ahead for it: training stays
    exact, but the rows it needs were not admitted ahead (more rows move, some are served from the host)."""


class IdsMismatchCheck:
    """Per cache, the module it serves; warns once per module when its cache counts unread lookups."""

    def __init__(self, modules: Sequence, caches: list[EmbeddingCache], cache_module: list[int],
                 describe, ids_given: bool):
        self.modules, self.caches, self.cache_module = modules, caches, cache_module
        self.describe, self.ids_given = describe, ids_given
        for cache in caches:
            cache.unread_ahead.zero_()  # counted per loop (a device op: no sync)
        self.landed = [None if counts_on_host(c.device) else MissEstimate(c.device, lag=1) for c in caches]

    def after_batch(self) -> None:
        """After a batch's forward: host counts are read now."""
        for c, cache in enumerate(self.caches):
            if self.landed[c] is None and int(cache.unread_ahead):
                self._warn(c)

    def at_window(self) -> None:
        """At a window start: device counts landed are read, and a copy of the current one started."""
        for c, cache in enumerate(self.caches):
            if self.landed[c] is None:
                continue
            if self.landed[c].value():
                self._warn(c)
            misses, cache.window_forward_misses = cache.window_forward_misses, None
            if misses is not None:
                self.landed[c].push(misses)

    def at_end(self) -> None:
        """When the loop ends: every count read (a device's too: the loop is over, nothing waits behind it)."""
        for c, cache in enumerate(self.caches):
            last = cache.window_forward_misses
            landed = self.landed[c].value() if self.landed[c] is not None else None
            if int(cache.unread_ahead.cpu()) or landed or (last is not None and int(last.cpu())):
                self._warn(c)
            cache.window_forward_misses = None

    def _warn(self, c: int) -> None:
        module = self.modules[self.cache_module[c]]
        if getattr(module, "_warned_prefetch_ids", False):
            return
        try:
            module._warned_prefetch_ids = True
        except AttributeError:
            pass
        fix = ("check that ids(batch) gives each module the ids its forward looks up, in the order of modules"
               if self.ids_given else
               "pass prefetch(..., ids=lambda batch: [ids_for_module_0, ...]), one id tensor per module in the "
               "order of modules")
        warnings.warn(f"cachedemb.prefetch: a forward of {self.describe(self.modules, self.cache_module[c])} "
                      f"looked up ids that were not read ahead for it, so its rows were not prefetched (training "
                      f"stays exact, but rows move at its forward or are served from the host): {fix}",
                      PrefetchIdsWarning, stacklevel=4)
