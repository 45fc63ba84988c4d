"""Next-use bookkeeping over the id horizon: each id's uses among the last `span` batches read, as bits.

Memory is O(distinct ids among those batches) (an `IdMap` of W = ceil(span / 64) words per id: bit p of an
id's words says it is used by the batch at ring position p = batch % span; plus each batch's distinct ids and
their map positions until its position comes round again), never O(table rows): a 1B-row table costs what its
horizon's ids cost. Work per batch is O(its distinct ids): clear the ring position it takes over (the uses of the
batch `span` earlier; ids left with no use leave the map), set it for its own ids.

Queries read only the bits of the batches they ask about, so reading further ahead (entering batches past the
queried range) never changes an answer, and nothing is retired: answers are a function of the batches alone,
however far ahead a thread has read. A query about batches [lo, hi) needs lo >= entered - span (their positions
not yet taken over) and hi <= entered (or the source ended).

- `first_use(ids, now, horizon)`: each id's first use in [now, now + horizon), O(len(ids));
- `slot_uses(ids, now, horizon)`: the same for the cache's slot ids, which change little between windows: their
  map positions are kept from the last call and found again only where the id there changed;
- `used_between(batch, lo, hi)`: which of a batch's distinct ids are used in [lo, hi); `unused_between` the
  others' indices, up to a budget (window unions).
"""
from __future__ import annotations

import torch

from cachedemb.cache.host_memory import host_empty
from cachedemb.kernels.host_nonzero import nonzero_1d
from cachedemb.prefetch import host_map
from cachedemb.prefetch.id_map import IdMap


def _signed(word: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    return word - (1 << 64) if word >= 1 << 63 else word


def lowest_bit(x: torch.Tensor) -> torch.Tensor:
    """Index of the lowest set bit of each nonzero int64 (x & -x is a power of two, exact in float64)."""
    return torch.frexp((x & -x).to(torch.float64)).exponent.to(torch.int64) - 1


SLIDE_SHARE = 4  # move the last answer on only where it touches under 1/4 of the slots' worth of ids


class NextUseTracker:
    """Uses of each id among the batches read ahead (see the module docstring).

    `enter(batch, uniq)` adds a batch's distinct ids, batches in order from 0. `num_rows` only checks ids; `span`
    bounds how far the entered batches may run ahead of the oldest batch a query asks about. The consumer-side
    view of the first tracker (`retire(batch)`, then `next_use[ids]` over every batch entered) is kept.
    """

    def __init__(self, num_rows: int | None = None, span: int = 128):
        if not isinstance(span, int) or span < 1:
            raise ValueError(f"span must be an int >= 1 (batches whose uses are kept), got {span!r}")
        self.num_rows = num_rows
        self.span = span
        self.map = IdMap((span + 63) // 64)
        self.entered = 0  # batches entered so far: 0 .. entered - 1
        # batch -> (its distinct ids, their map positions, the map's relayout count then), for the last `span`
        self.ring: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.retired_upto = 0  # the origin of `next_use[...]`
        # the slot ids of the last `slot_uses`, their (pinned) map positions, the map's relayout count then
        self._slots = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), -1)
        # the last `slot_uses` answer (lo, hi, first uses), moved on by the next call; the slot at each map position
        self._uses: tuple[int, int, torch.Tensor] | None = None
        self._slot_at: torch.Tensor | None = None

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
        c = host_map.NATIVE.get()
        old = self.ring.pop(batch - self.span, None)
        if old is not None:  # the position now means `batch`: clear the uses of the batch `span` earlier
            _, pos = self._positions(old)
            if c is not None:  # (and drop the ids with no use left in the ring)
                self.map.used -= host_map.bits_clear_drop(c, self.map.keys, self.map.words, self.map.pinned, word,
                                                          bit, pos)
            else:
                column = self.map.words[:, word]
                column.index_copy_(0, pos, column.index_select(0, pos) & ~bit)
                self.map.drop_empty(pos)  # ids with no use left in the ring
        self.map.reserve(uniq.numel())  # before finding: growing the map moves every position
        pos = self.map.find(uniq)
        new = nonzero_1d(pos < 0)
        if new.numel():
            layout = self.map.relayouts
            pos.index_copy_(0, new, self.map.insert(uniq.index_select(0, new)))
            if self.map.relayouts != layout:  # the insert had to lay the map out anew
                pos = self.map.find(uniq)
        if c is not None:
            host_map.bits_set(c, self.map.words, word, bit, pos)
        else:
            column = self.map.words[:, word]
            column.index_copy_(0, pos, column.index_select(0, pos) | bit)
        self.ring[batch] = (uniq, pos, self.map.relayouts)
        self.entered += 1

    def _positions(self, entry) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, map positions) of a ring entry, found again if the map was laid out since."""
        ids, pos, relayouts = entry
        return ids, (pos if relayouts == self.map.relayouts else self.map.find(ids))

    def ring_entry(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct ids, their map positions) of a batch still in the ring."""
        return self._positions(self.ring[batch])

    def scratch(self) -> torch.Tensor:
        """An int32 array over the map's positions for a caller's per-id values (contents undefined)."""
        if getattr(self, "_scratch", None) is None or self._scratch.numel() != self.map.keys.numel():
            self._scratch = host_empty((self.map.keys.numel(),), torch.int32, pinned=False)  # as the map's
        return self._scratch

    # ----------------------------------------------------------------- queries
    def _check(self, lo: int) -> None:
        if lo < self.entered - self.span:
            raise ValueError(f"batch {lo} left the tracker's span ({self.span} batches before batch "
                             f"{self.entered}): query before reading that far ahead, or use a larger span")

    def _segments(self, lo: int, hi: int):
        """(word, lo bit, hi bit, batch at lo bit) covering the positions of batches [lo, hi) in batch order."""
        batch = lo
        while batch < hi:
            position = batch % self.span
            run = min(hi - batch, self.span - position, 64 - position % 64)
            yield position // 64, position % 64, position % 64 + run, batch
            batch += run

    def _masks(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(word, bit mask, batch of bit 0) per segment of [lo, hi), in batch order: the C loops' form."""
        return [(word, _signed(((1 << (hi_bit - lo_bit)) - 1) << lo_bit), first_batch - lo_bit)
                for word, lo_bit, hi_bit, first_batch in self._segments(lo, hi)]

    def _first_in(self, pos: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """First batch in [lo, hi) whose bit is set in the words at map positions `pos`, -1: none."""
        c = host_map.NATIVE.get()
        if c is not None:
            return host_map.first_in(c, self.map.words, pos, self._masks(lo, hi))
        rows = self.map.words.index_select(0, pos)
        value = base = None  # per id: the bits of the first segment that has any, and the batch of its bit 0
        for word, lo_bit, hi_bit, first_batch in self._segments(lo, hi):
            seg = rows[:, word] & _signed(((1 << (hi_bit - lo_bit)) - 1) << lo_bit)
            if value is None:
                value, base = seg, torch.full_like(seg, first_batch - lo_bit)
            else:
                take = value == 0
                value = torch.where(take, seg, value)
                base.masked_fill_(take, first_batch - lo_bit)
        if value is None:
            return torch.full_like(pos, -1)
        return torch.where(value != 0, base + lowest_bit(value), torch.full_like(value, -1))

    def _range(self, now: int, horizon: int) -> tuple[int, int]:
        self._check(now)
        return now, min(now + max(horizon, 0), self.entered)

    def first_use(self, ids: torch.Tensor, now: int, horizon: int) -> torch.Tensor:
        """Each id's first use among batches [now, now + horizon) entered so far (absolute), -1 for none."""
        lo, hi = self._range(now, horizon)
        ids = ids.reshape(-1).to(torch.int64)
        out = torch.full_like(ids, -1)
        if hi <= lo or ids.numel() == 0:
            return out
        pos = self.map.find(ids.clamp(min=0))
        at = nonzero_1d((pos >= 0) & (ids >= 0))
        out.index_copy_(0, at, self._first_in(pos.index_select(0, at), lo, hi))
        return out

    def slot_uses(self, ids: torch.Tensor, now: int, horizon: int, relative: bool = False) -> torch.Tensor:
        """`first_use` for a cache's slot ids (-1: empty slot). Their map positions are pinned and kept between
        calls (an absent id is added with no uses; later batches set its bits there), so a call finds only the
        ids of slots that changed since the last one, and moves the last answer on (`_slide`): O(changed + the
        ids of the batches that left or entered the range) probes and gathers, plus O(slots) elementwise
        compares and copies. `relative`: as batches from `now` (-1: none), what the policy takes. Either way a
        tensor of the caller's."""
        lo, hi = self._range(now, horizon)
        ids = ids.reshape(-1).to(torch.int64)
        kept_ids, kept_pos, layout = self._slots
        c = host_map.NATIVE.get()
        if kept_ids.shape == ids.shape and layout == self.map.relayouts:
            pos = kept_pos  # updated in place at the changed slots (kept only by this tracker)
            changed = host_map.changed(c, ids, kept_ids) if c is not None else nonzero_1d(ids != kept_ids)
            old = kept_pos.index_select(0, changed)
            old = old[old != self.map.none]
            self._fill(self.map.pinned, old, False)
            self.map.drop_empty(old)
        else:  # first call, or the map was laid out anew: every position moved
            old = None
            self.map.pinned.zero_()
            pos = torch.full_like(ids, self.map.none)
            changed = torch.arange(ids.numel())
        again = changed[ids.index_select(0, changed) >= 0]
        pos.index_fill_(0, changed, self.map.none)
        if again.numel():
            layout = self.map.relayouts
            self.map.reserve(again.numel())
            wanted = ids.index_select(0, again)
            found = self.map.find(wanted)
            absent = nonzero_1d(found < 0)
            if absent.numel():
                found.index_copy_(0, absent, self._insert_absent(wanted.index_select(0, absent)))
            if self.map.relayouts != layout:  # laid out anew meanwhile: start over with every position
                self._slots = (ids[:0], ids[:0], -1)
                self._uses = None
                return self.slot_uses(ids, now, horizon)
            pos.index_copy_(0, again, found)
            self._fill(self.map.pinned, found, True)
        incremental = self._uses is not None and self._slot_at is not None and changed.numel() < ids.numel() \
            and self._uses[2].shape == ids.shape and layout == self.map.relayouts
        tracked = self._track_slots(pos, changed if incremental else None, old if incremental else None)
        incremental = incremental and tracked
        self._slots = (ids, pos, self.map.relayouts)
        if hi <= lo:
            self._uses = None
            return torch.full_like(ids, -1)
        uses = self._slide(pos, changed, lo, hi) if incremental else None
        if uses is None:
            uses = self._first_in(pos, lo, hi)
        self._uses = (lo, hi, uses)
        if relative:  # a new tensor: the kept one is updated in place by the next call
            return host_map.relative(c, uses, now) if c is not None else (uses - now).masked_fill_(uses < 0, -1)
        return uses.clone()

    def _slide(self, pos: torch.Tensor, changed: torch.Tensor, lo: int, hi: int) -> torch.Tensor | None:
        """The last answer moved to [lo, hi) in O(changed slots + the distinct ids of the batches that left or
        entered the range), not O(slots); None when the ranges do not allow it. A kept first use p: p >= lo
        stays (nothing before it in [lo, hi)); 0 <= p < lo (an id of a batch that left the range) and changed
        slots are found again; p = -1 (no use in the last range) can only become a use in the batches that
        entered, [last hi, hi). Slots are found from those batches' map positions through `_slot_at`."""
        last_lo, last_hi, uses = self._uses
        if lo < last_lo or hi < last_hi or last_hi < lo or last_lo < self.entered - self.span:
            return None
        moved = [*range(last_lo, lo), *range(last_hi, hi)]
        if SLIDE_SHARE * (changed.numel() + sum(self.ring[b][0].numel() for b in moved)) > uses.numel():
            return None  # about as much work as finding every slot's first use
        slot_at = self._slot_at
        c = host_map.NATIVE.get()
        if c is not None:  # the same passes in C, one per batch, no index tensors built
            words, now_range = self.map.words, self._masks(lo, hi)
            host_map.slide_pass(c, words, pos, uses, None, changed, host_map.ALWAYS, lo, now_range)
            for batch in range(last_lo, lo):
                host_map.slide_pass(c, words, pos, uses, slot_at, self.ring_entry(batch)[1], host_map.LEFT_RANGE,
                                    lo, now_range)
            entered = self._masks(last_hi, hi)
            for batch in range(last_hi, hi):
                host_map.slide_pass(c, words, pos, uses, slot_at, self.ring_entry(batch)[1], host_map.NONE_YET,
                                    lo, entered)
            return uses
        again = [changed]
        for batch in range(last_lo, lo):
            s = slot_at.index_select(0, self.ring_entry(batch)[1])
            s = s[s >= 0]
            again.append(s[uses.index_select(0, s) < lo])  # its first use was in the batches that left
        again = torch.cat(again)
        if again.numel():
            uses.index_copy_(0, again, self._first_in(pos.index_select(0, again), lo, hi))
        for batch in range(last_hi, hi):
            s = slot_at.index_select(0, self.ring_entry(batch)[1])
            s = s[s >= 0]
            s = s[uses.index_select(0, s) == -1]
            if s.numel():
                uses.index_copy_(0, s, self._first_in(pos.index_select(0, s), last_hi, hi))
        return uses

    def _track_slots(self, pos: torch.Tensor, changed: torch.Tensor | None, old: torch.Tensor | None) -> bool:
        """`_slot_at[position]`: the slot whose id sits at that map position, -1 for none (all slots when
        `changed` is None; else the changed ones, whose old positions were `old`). False (and nothing kept)
        where two slots hold one id: a cache's slots never do, but a caller's ids may."""
        size = self.map.keys.numel()
        if changed is None or self._slot_at is None or self._slot_at.numel() != size:
            # huge-page advised like the map it indexes (random access over tens of MB)
            self._slot_at = host_empty((size,), torch.int64, pinned=False).fill_(-1)
            changed = torch.arange(pos.numel())
        elif old is not None:
            self._fill(self._slot_at, old, -1)
        c = host_map.NATIVE.get()
        if c is not None:
            if not host_map.track_slots(c, self._slot_at, pos, changed, self.map.none):
                self._slot_at = None
                return False
            return True
        at = pos.index_select(0, changed)
        live = at != self.map.none
        changed, at = changed[live], at[live]
        ok = bool((self._slot_at.index_select(0, at) < 0).all())  # no other slot at those positions
        self._slot_at.index_copy_(0, at, changed)
        ok = ok and bool((self._slot_at.index_select(0, at) == changed).all())  # nor two of the changed ones
        if not ok:
            self._slot_at = None
        return ok

    @staticmethod
    def _fill(target: torch.Tensor, pos: torch.Tensor, value) -> None:
        c = host_map.NATIVE.get()
        if c is not None:
            host_map.fill(c, target, pos, value)
        else:
            target.index_fill_(0, pos, value)

    def _insert_absent(self, ids: torch.Tensor) -> torch.Tensor:
        """Positions of absent ids (duplicates allowed), inserted once each with no uses."""
        uniq, inverse = torch.unique(ids, return_inverse=True)
        return self.map.insert(uniq).index_select(0, inverse)

    def used_between(self, batch: int, lo: int, hi: int) -> torch.Tensor:
        """For each distinct id of `batch` (in `ring` order): is it used by a batch in [lo, hi)?"""
        self._check(lo)
        _, pos = self.ring_entry(batch)
        return self._first_in(pos, lo, hi) >= 0

    def unused_between(self, batch: int, lo: int, hi: int, budget: int) -> torch.Tensor | None:
        """Indices (in `ring` order) of `batch`'s distinct ids that no batch in [lo, hi) uses, or None as soon as
        there are more than `budget` of them (a window planner stops reading there)."""
        self._check(lo)
        _, pos = self.ring_entry(batch)
        budget = max(budget, 0)
        c = host_map.NATIVE.get()
        if c is None or hi <= lo:
            fresh = nonzero_1d(self._first_in(pos, lo, hi) < 0)
            return None if fresh.numel() > budget else fresh
        return host_map.unused_in(c, self.map.words, pos, [
            (word, _signed(((1 << (hi_bit - lo_bit)) - 1) << lo_bit), 0)
            for word, lo_bit, hi_bit, _ in self._segments(lo, hi)], budget)

    def nbytes(self) -> int:
        """Host bytes held: the map, the ring of distinct ids and their positions, the kept slot ids, positions
        and first uses, the position -> slot array."""
        ring = sum(ids.numel() * 16 for ids, _, _ in self.ring.values())
        kept = [t for t in (self._uses[2] if self._uses else None, self._slot_at) if t is not None]
        return self.map.nbytes() + ring + self._slots[0].numel() * 16 + sum(t.numel() * 8 for t in kept)

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
