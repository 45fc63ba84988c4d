"""The look-ahead pipeline (docstring to come)."""
from cachedemb.prefetch.next_use import NextUseTracker
from cachedemb.prefetch.pipeline import Prefetcher, prefetch

__all__ = ["NextUseTracker", "Prefetcher", "prefetch"]
