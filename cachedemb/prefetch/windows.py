"""Window planning: which batches are admitted together, chosen from what fits, and their union.

A window of K batches protects its union for K steps; the rest of the cache is where the eviction policy
chooses. One batch must be resident for its own forward anyway (the constraint Belady-OPT has too), so a window
of one batch may fill the cache. A window of more batches also holds the later ones resident meanwhile: once that
protects most of the cache the policy has no choice left, and the window moves as many rows as the per-batch path
while costing more, so such a window may take at most `FILL` of a cache's slots. K is the largest count <= depth
whose union fits in every cache; a batch that does not fit even alone gives K = 0: it takes the modules' own
per-batch path (misses beyond the free slots served from the host), and the next window starts after it.

The union is built once, batch by batch, with no sort: a batch adds its ids that no earlier batch of the window
uses (`NextUseTracker.used_between`, the bits the tracker keeps anyway), and the first batch that would overflow
ends the window: no plan is made, shrunk and made again. Each batch's distinct ids are located in the union
(`positions`), so a forward inside the window can take its cache slots from the window's admission instead of
looking them up.

Each window also counts its rows outside the window before it (`new_rows`, |B - A| for the window B after A): the
pipeline's overlap test is on the union of the two, |A| + |B - A| = |A or B|, not on |A| + |B|
(docs/prefetch.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cachedemb.prefetch.next_use import NextUseTracker

FILL = 0.5  # a window of two or more batches protects at most this share of a cache's slots


@dataclass
class WindowInfo:
    """Batches [start, start + count) admitted together; count 0: batch `start` takes the per-batch path."""

    start: int
    count: int
    unions: list[torch.Tensor] | None  # per cache: the window's distinct ids (host; in batch order, not sorted)
    positions: list[list[torch.Tensor]] | None  # per batch, per cache: where its distinct ids sit in the union
    # per cache: the union's ids no batch of the window before it uses (|B - A|; the whole union for the first)
    new_rows: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + max(self.count, 1)


def window_limit(capacity: int, count: int) -> int:
    """The most distinct ids a window of `count` batches may hold in a cache of `capacity` rows."""
    return capacity if count == 1 else int(capacity * FILL)


def plan_window(start: int, available: int, trackers: list[NextUseTracker], capacities: list[int], depth: int,
                locate: bool, prev_start: int | None = None) -> WindowInfo:
    """The window starting at `start` over the next `available` batches read (at most `depth` taken), per cache
    c of `capacities[c]` rows whose batches `trackers[c]` holds (a `NextUseTracker`, or the device read-ahead's
    `SortedIdsTracker`, which keeps no map positions and so plans windows that locate nothing). `prev_start`: the
    start of the window before it (batches [prev_start, start)), against which `new_rows` is counted."""
    added: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per batch, per cache: (ids, map positions) it adds
    sizes = [0] * len(trackers)
    outside = [0] * len(trackers)  # per cache: ids of the batches taken that neither the previous window uses
    prev = start if prev_start is None else prev_start
    for k in range(min(available, depth)):
        batch = start + k
        fresh = []
        for tracker, size, cap in zip(trackers, sizes, capacities):
            ids, pos = tracker.ring_entry(batch)
            if k:
                # the batch's ids no earlier batch of the window uses; reading stops once they cannot fit
                new = tracker.unused_between(batch, start, batch, window_limit(cap, k + 1) - size)
                if new is None:
                    break
                ids, pos = ids.index_select(0, new), (pos.index_select(0, new) if pos is not None else None)
            fresh.append((ids, pos))
        if len(fresh) < len(trackers):
            break
        grown = [size + ids.numel() for size, (ids, _) in zip(sizes, fresh)]
        if any(g > window_limit(cap, k + 1) for g, cap in zip(grown, capacities)):
            break
        added.append(fresh)
        sizes = grown
        for c, (tracker, (ids, _)) in enumerate(zip(trackers, fresh)):
            # ids no earlier batch of this window nor of the previous one uses: each of B - A counted once, at its
            # first batch in B (the two windows are adjacent: [prev, batch) covers both)
            if prev >= start:
                outside[c] += ids.numel()
            else:
                whole = tracker.ring_entry(batch)[0].numel()
                outside[c] += tracker.unused_between(batch, prev, batch, whole).numel()
    count = len(added)
    if count == 0:
        return WindowInfo(start, 0, None, None)
    unions = [torch.cat([batch[c][0] for batch in added]) for c in range(len(trackers))]
    positions = None
    if locate:
        positions = [[] for _ in range(count)]
        for c, tracker in enumerate(trackers):
            # each union id's index, written at its map position; a batch's ids read theirs from there
            index = tracker.scratch()
            index.index_copy_(0, torch.cat([batch[c][1] for batch in added]),
                              torch.arange(unions[c].numel(), dtype=index.dtype))
            for k in range(count):
                positions[k].append(index.index_select(0, tracker.ring_entry(start + k)[1]).to(torch.int64))
    return WindowInfo(start, count, unions, positions, outside)
