"""Next-use bookkeeping over the id horizon: each id's uses among the last `span` batches read, as bits.

Memory is O(distinct ids among those batches) (an `IdMap` of W = ceil(span / 64) words per id, plus each
batch's distinct ids until its ring position comes round again), never O(table rows): a 1B-row table costs what
its horizon's ids cost. Work per batch is O(its distinct ids): clear the ring position it takes over (the ids of
the batch `span` earlier; those left with no use leave the map), set it for its own ids. A query `next_use(ids, now, horizon)` reads, per id, the
first set bit among the positions of batches [now, now + horizon): O(len(ids)) (`first_use`).

A query only reads positions of batches in its range, so reading further ahead (entering batches past
now + horizon) never changes its answer, and no batch needs to be retired: the answer is a function of the
batches alone, whatever thread ran ahead how far. It needs now >= entered - span (the range's positions not yet
taken over) and, for the whole horizon, entered >= now + horizon (or the source ended).
"""
from __future__ import annotations

import torch

from cachedemb.prefetch.id_map import IdMap


def _signed(word: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    return word - (1 << 64) if word >= 1 << 63 else word


def lowest_bit(x: torch.Tensor) -> torch.Tensor:
    """Index of the lowest set bit of each nonzero int64 (x & -x is a power of two, exact in float64)."""
    return torch.frexp((x & -x).to(torch.float64)).exponent.to(torch.int64) - 1


class NextUseTracker:
    """Uses of each id among the batches read ahead (see the module docstring).

    `enter(batch, uniq)` adds a batch's distinct ids, batches in order from 0; `first_use(ids, now, horizon)`
    gives each id's first use in [now, now + horizon) (absolute batch number, -1 for none). `num_rows` only
    checks ids; `span` bounds how far the entered batches may run ahead of the oldest query. The consumer-side
    view of the first tracker (`retire(batch)`, then `next_use[ids]` over every batch entered) is kept.
    """

    def __init__(self, num_rows: int | None = None, span: int = 128):
        if not isinstance(span, int) or span < 1:
            raise ValueError(f"span must be an int >= 1 (batches whose uses are kept), got {span!r}")
        self.num_rows = num_rows
        self.span = span
        self.words = (span + 63) // 64
        self.map = IdMap(self.words)
        self.entered = 0  # batches entered so far: 0 .. entered - 1
        # batch -> (its distinct ids, their map positions, the map's relayout count then), for the last `span`
        self.ring: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.retired_upto = 0  # the origin of `next_use[...]` (the old tracker's interface)

    # ----------------------------------------------------------------- entering batches
    def _bit(self, batch: int) -> tuple[int, int]:
        position = batch % self.span
        return position // 64, _signed(1 << (position % 64))

    def enter(self, batch: int, uniq: torch.Tensor) -> None:
        """Batch `batch` (its distinct ids `uniq`, host int64) joins the horizon."""
        if batch != self.entered:
            raise ValueError(f"batches enter in order: expected batch {self.entered}, got {batch}")
        uniq = uniq.reshape(-1).to(torch.int64)
        if self.num_rows is not None and uniq.numel() and (int(uniq.min()) < 0 or int(uniq.max()) >= self.num_rows):
            raise ValueError(f"ids must be in [0, {self.num_rows}), got {int(uniq.min())}..{int(uniq.max())}")
        word, bit = self._bit(batch)
        old = self.ring.pop(batch - self.span, None)
        if old is not None:  # the position now means `batch`: clear the uses of the batch `span` earlier
            ids, pos, relayouts = old
            if relayouts != self.map.relayouts:
                pos = self.map.find(ids)
            column = self.map.words[word]
            column.index_copy_(0, pos, column.index_select(0, pos) & ~bit)
            self.map.drop_empty(pos)  # ids with no use left in the ring
        self.map.reserve(uniq.numel())  # before finding: growing the map moves every position
        pos = self.map.find(uniq)
        new = (pos < 0).nonzero().squeeze(1)
        if new.numel():
            pos.index_copy_(0, new, self.map.insert(uniq.index_select(0, new)))
        column = self.map.words[word]
        column.index_copy_(0, pos, column.index_select(0, pos) | bit)
        self.ring[batch] = (uniq, pos, self.map.relayouts)
        self.entered += 1

    # ----------------------------------------------------------------- queries
    def first_use(self, ids: torch.Tensor, now: int, horizon: int) -> torch.Tensor:
        """Each id's first use among batches [now, now + horizon) entered so far (absolute), -1 for none."""
        if now < self.entered - self.span:
            raise ValueError(f"batch {now} left the tracker's span ({self.span} batches before batch "
                             f"{self.entered}): query before reading that far ahead, or use a larger span")
        ids = ids.reshape(-1).to(torch.int64)
        out = torch.full_like(ids, -1)
        end = min(now + max(horizon, 0), self.entered)
        if end <= now or ids.numel() == 0:
            return out
        pos = self.map.find(ids.clamp(min=0))
        at = ((pos >= 0) & (ids >= 0)).nonzero().squeeze(1)
        pos = pos.index_select(0, at)
        columns = {}
        found = torch.full((at.numel(),), -1, dtype=torch.int64)
        for word, lo, hi, first_batch in self._segments(now, end):
            if word not in columns:
                columns[word] = self.map.words[word].index_select(0, pos)
            mask = _signed(((1 << (hi - lo)) - 1) << lo)
            seg = columns[word] & mask
            hit = (seg != 0) & (found < 0)
            found = torch.where(hit, first_batch + lowest_bit(seg) - lo, found)
        out.index_copy_(0, at, found)
        return out

    def _segments(self, now: int, end: int):
        """(word, lo bit, hi bit, batch at lo) covering the positions of batches [now, end) in batch order."""
        batch = now
        while batch < end:
            position = batch % self.span
            run = min(end - batch, self.span - position, 64 - position % 64)
            yield position // 64, position % 64, position % 64 + run, batch
            batch += run

    def nbytes(self) -> int:
        """Host bytes held: the map and the ring of distinct ids."""
        return self.map.nbytes() + sum(2 * ids.numel() * ids.element_size() for ids, _, _ in self.ring.values())

    # ----------------------------------------------------------------- the retiring interface
    def retire(self, batch: int, uniq: torch.Tensor | None = None) -> None:
        """Batch `batch` was used: `next_use[...]` now answers from batch + 1 on."""
        self.retired_upto = batch + 1

    @property
    def next_use(self) -> "_NextUseIndexer":
        """`tracker.next_use[ids]`: first uses from the retired origin over every batch entered."""
        return _NextUseIndexer(self)


class _NextUseIndexer:
    """Indexing view of `first_use` from the retired origin."""

    def __init__(self, tracker: NextUseTracker):
        self.tracker = tracker

    def __getitem__(self, ids) -> torch.Tensor:
        t = self.tracker
        query = torch.as_tensor(ids, dtype=torch.int64)
        return t.first_use(query, t.retired_upto, t.entered - t.retired_upto).reshape(query.shape)
