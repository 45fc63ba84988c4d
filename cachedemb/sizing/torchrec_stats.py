"""A table's miss-ratio curve as torchrec's planner takes cache statistics.

torchrec's `CacheParams(stats=...)` (torchrec.distributed.types) takes a `CacheStatistics`: `expected_lookups`
(distinct ids per training batch), `expected_miss_rate(clf)` (the miss rate of a cache holding clf of the
table's rows: 1 at clf 0, 0 at clf 1, where the whole table is on the device) and `cacheability` (0 very
cacheable ... 1 not at all; torchrec's own `EmbeddingOffloadStats` uses the area under the miss-ratio curve,
and so does this). The planner's EmbeddingOffloadScaleupProposer ranks tables by cacheability × expected
lookups when it grows caches. torchrec is optional: the class is registered as a virtual subclass of torchrec's
ABC when torchrec is importable, so `isinstance(stats, CacheStatistics)` holds without importing it here.
"""
from __future__ import annotations

import numpy as np

from cachedemb.sizing.curves import MissRatioCurve


class CurveCacheStatistics:
    """torchrec `CacheStatistics` from a `MissRatioCurve` of a table of ``num_embeddings`` rows."""

    def __init__(self, curve: MissRatioCurve, num_embeddings: int):
        if isinstance(num_embeddings, bool) or int(num_embeddings) < 1:
            raise ValueError(f"num_embeddings must be a positive int, got {num_embeddings!r}")
        self.curve = curve
        self.num_embeddings = int(num_embeddings)
        _register()

    @property
    def expected_lookups(self) -> float:
        return float(self.curve.unique_per_batch)

    def expected_miss_rate(self, clf: float) -> float:
        clf = float(clf)
        if clf <= 0:
            return 1.0
        if clf >= 1:
            return 0.0
        return float(self.curve.miss_ratio_at(clf * self.num_embeddings))

    @property
    def cacheability(self) -> float:
        """The miss ratio averaged over load factors 0..1 (trapezoids over the curve's points)."""
        x = np.clip(self.curve.sizes / self.num_embeddings, 0.0, 1.0)
        y = self.curve.miss_ratio
        if x[-1] < 1.0:  # flat past the last point, 0 at clf 1 (the whole table on the device)
            x, y = np.append(x, 1.0), np.append(y, y[-1])
        return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2))

    def __repr__(self) -> str:
        return (f"CurveCacheStatistics(expected_lookups={self.expected_lookups:.1f}, "
                f"cacheability={self.cacheability:.4f}, policy={self.curve.policy!r})")


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    try:
        from torchrec.distributed.types import CacheStatistics
    except Exception:  # torchrec absent or not importable here: duck typing still serves the planner
        return
    CacheStatistics.register(CurveCacheStatistics)
    _registered = True


__all__ = ["CurveCacheStatistics"]
