"""Window planning: which batches are admitted together, chosen from what fits, and their union.

A window of K batches protects its union for K steps; the rest of the cache is where the eviction policy
chooses. One batch must be resident for its own forward anyway (the constraint Belady-OPT has too), so a window
of one batch may fill the cache. A window of more batches also holds the later ones resident meanwhile: once that
protects most of the cache the policy has no choice left, and the window moves as many rows as the per-batch path
while costing more, so such a window may take at most `FILL` of a cache's slots. K is the largest count <= depth
whose union fits in every cache; a batch that does not fit even alone gives K = 0: it takes the modules' own
per-batch path (misses beyond the free slots served from the host), and the next window starts after it.

The unions are built once, batch by batch (the union of k + 1 batches is the union of k and one more batch),
stopping at the first that does not fit: no plan is made, shrunk and made again. Each batch's distinct ids are
located in the union (`positions`), so a forward inside the window can take its cache slots from the window's
admission instead of looking them up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FILL = 0.5  # a window of two or more batches protects at most this share of a cache's slots


@dataclass
class WindowInfo:
    """Batches [start, start + count) admitted together; count 0: batch `start` takes the per-batch path."""

    start: int
    count: int
    unions: list[torch.Tensor] | None  # per cache: the window's distinct ids, ascending (host)
    positions: list[list[torch.Tensor]] | None  # per batch, per cache: where its distinct ids sit in the union

    @property
    def end(self) -> int:
        return self.start + max(self.count, 1)


def window_limit(capacity: int, count: int) -> int:
    """The most distinct ids a window of `count` batches may hold in a cache of `capacity` rows."""
    return capacity if count == 1 else int(capacity * FILL)


def plan_window(start: int, uniq: list[list[torch.Tensor]], capacities: list[int], depth: int,
                locate: bool) -> WindowInfo:
    """The window starting at `start` over the distinct ids `uniq[i][c]` of batches start + i (as many as were
    read, at most `depth`), per cache c of `capacities` rows."""
    unions = None
    count = 0
    for batch in uniq[:depth]:
        grown = [u if unions is None else torch.unique(torch.cat([unions[c], u])) for c, u in enumerate(batch)]
        if any(g.numel() > window_limit(cap, count + 1) for g, cap in zip(grown, capacities)):
            break
        unions, count = grown, count + 1
    if count == 0:
        return WindowInfo(start, 0, None, None)
    positions = None
    if locate:
        positions = [[torch.searchsorted(unions[c], u) for c, u in enumerate(batch)] for batch in uniq[:count]]
    return WindowInfo(start, count, unions, positions)
