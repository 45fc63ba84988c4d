"""A host hash map from int64 ids to W int64 words: the look-ahead's per-id memory, O(ids it holds).

Open addressing with linear probing over `keys [S + TAIL + 1]` (EMPTY = -1): an id's home is in [0, S), S a power
of two kept >= 8/5 x the positions used, and probes run forward into a tail of TAIL positions instead of wrapping
round (the last position stays EMPTY with zero words: every probe ends, and it stands for "no id"). The words sit
beside the keys in rows, `words [S + TAIL + 1, W]`, so one gather yields all of an id's words. The home is the top
bits of a multiplicative hash, so ids equal in their low bits (a table's stride, a shard's residue) still spread.

`drop_empty(positions)` turns the entries there whose words are all zero into TOMB (-2), unless pinned: probes go
past a TOMB and inserts reuse it, so a map whose ids come and go (the horizon sliding on) keeps its size. In C a TOMB
followed by EMPTY becomes EMPTY (with the TOMBs before it): it ends no probe an EMPTY would not. Without that the
TOMBs of a sliding horizon filled the map to 5/8 every ~30 batches (8M-row Zipf ids, horizon 64), and each
relayout (~150 ms) moved every position the tracker holds, to be found again. A pinned
position keeps its id (and its position) until unpinned, words zero or not: an owner holding positions pins them.
When the used positions (ids and TOMBs) would pass 5/8 of S, the ids with a nonzero word or a pin are laid out
again in one sort (position = home + the run of keys stacked before it: a cummax over the keys sorted by home) at
GROW x their number. Positions stay put between relayouts; `relayouts` counts them, so an owner can keep positions.

Host only, for the read-ahead thread: counts are read on the host freely (each probe round keeps only the ids
still probing), and torch ops release the GIL while they run.
"""
from __future__ import annotations

import torch

from cachedemb.cache.host_memory import host_empty
from cachedemb.kernels.host_nonzero import nonzero_1d
from cachedemb.prefetch import host_map

EMPTY = -1
TOMB = -2
TAIL = 1024  # probe positions past the last home; a probe that would run past them makes the map grow
_MULT = -7046029254386353131  # 0x9E3779B97F4A7C15 (2^64 / golden ratio) as a signed int64
_MIN_SIZE = 16
GROW = 3  # a relayout sizes the map for this many times the ids it keeps
_SINGLE_PROBES = 3  # probe rounds of one position each, then WINDOW positions a round
WINDOW = 16
_OFFSETS = torch.arange(WINDOW)


def _pow2_at_least(n: int) -> int:
    return max(_MIN_SIZE, 1 << max(0, int(n) - 1).bit_length())


class IdMap:
    """ids (>= 0) -> `width` int64 words each, zero for a new id."""

    def __init__(self, width: int, size: int = _MIN_SIZE):
        if width < 1:
            raise ValueError(f"an IdMap entry holds >= 1 words, got {width}")
        self.width = int(width)
        self.relayouts = 0
        self._allocate(_pow2_at_least(size))

    def _allocate(self, size: int) -> None:
        self.size = size
        # huge-page advised (host_empty): probes land at random in tens of MB (8M-row Zipf ids, horizon 64: a
        # 4M-position map, 100 MB); tracker.enter of a batch there 2.37 -> 2.12 ms on one core
        n = size + TAIL + 1
        self.keys = host_empty((n,), torch.int64, pinned=False).fill_(EMPTY)
        self.words = host_empty((n, self.width), torch.int64, pinned=False).zero_()
        self.pinned = host_empty((n,), torch.bool, pinned=False).zero_()
        self.used = 0  # positions holding an id or a TOMB

    @property
    def none(self) -> int:
        """A position that holds no id and zero words (for callers that need a position for "no id")."""
        return self.keys.numel() - 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.words, self.pinned))

    def _bits(self) -> int:
        return self.size.bit_length() - 1

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        # the top log2(S) bits of the wrapped product, made non-negative (>> is arithmetic on int64)
        return ((ids * _MULT) >> (64 - self._bits())) & (self.size - 1)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Position of each id in the map, -1 where it is absent. The first probes go one position at a time
        (most chains end there); the few ids still probing then look WINDOW positions ahead at once."""
        c = host_map.NATIVE.get()
        if c is not None:
            return host_map.find(c, self.keys, self._bits(), ids)
        pos = torch.full_like(ids, -1)
        idx = torch.arange(ids.numel())
        q, p = ids, self._home(ids)
        rounds = 0
        while idx.numel():
            if rounds < _SINGLE_PROBES:
                k = self.keys.index_select(0, p)
                hit = k == q
                found = nonzero_1d(hit)
                pos.index_copy_(0, idx.index_select(0, found), p.index_select(0, found))
                going = nonzero_1d(hit.logical_not() & (k != EMPTY))
                step = 1
            else:
                window = (p[:, None] + _OFFSETS).clamp(max=self.none)
                k = self.keys[window]
                hit = k == q[:, None]
                ended = hit | (k == EMPTY)
                stop = ended.any(1)
                first = ended.to(torch.int8).argmax(1)
                at = nonzero_1d(stop & hit.gather(1, first[:, None]).squeeze(1))
                pos.index_copy_(0, idx.index_select(0, at), p.index_select(0, at) + first.index_select(0, at))
                going = nonzero_1d(stop.logical_not())
                step = WINDOW
            idx, q, p = idx.index_select(0, going), q.index_select(0, going), p.index_select(0, going) + step
            rounds += 1
        return pos

    def reserve(self, extra: int) -> None:
        """Room for `extra` more ids below 5/8 full. Growing lays the map out again, which moves positions:
        call it before finding positions that an insert must not invalidate."""
        if 8 * (self.used + extra) > 5 * self.size:
            kept = self._kept()
            self._relayout(kept, GROW * (int(kept.sum()) + extra))

    def insert(self, ids: torch.Tensor) -> torch.Tensor:
        """Add distinct absent ids (their words zero); returns their positions. Positions found before stay
        valid if `reserve` made room first (else a growth may move them: see `relayouts`)."""
        self.reserve(ids.numel())
        pos, reused = self._probe_insert(ids)
        if pos is None:  # a probe ran past the tail (astronomically rare below 5/8 full): lay out bigger
            kept = self._kept()
            self._relayout(kept, 2 * GROW * (int(kept.sum()) + ids.numel()))
            pos, reused = self._probe_insert(ids)
        self.used += ids.numel() - reused
        return pos

    def _kept(self) -> torch.Tensor:
        """Positions a relayout keeps: ids with a nonzero word, and pinned ones."""
        return (self.keys >= 0) & ((self.words != 0).any(1) | self.pinned)

    def drop_empty(self, pos: torch.Tensor) -> None:
        """The ids at `pos` whose words are all zero leave the map (TOMB: later inserts reuse the position),
        unless pinned."""
        c = host_map.NATIVE.get()
        if c is not None:  # (and a TOMB that needs not stay becomes EMPTY: see host_map.c)
            self.used -= host_map.drop_empty(c, self.keys, self.words, self.pinned, pos)
            return
        empty = (self.words.index_select(0, pos) == 0).all(1) & self.pinned.index_select(0, pos).logical_not()
        self.keys.index_fill_(0, pos.index_select(0, nonzero_1d(empty)), TOMB)

    def _probe_insert(self, ids: torch.Tensor):
        """Each round every pending id tries its next position; among ids trying the same free (EMPTY or TOMB)
        position one wins (the write that lands), the rest probe on. Returns (positions, TOMBs reused), or
        (None, 0) with the map unchanged if a probe would leave the tail. (In C: one id after another, each at the
        first free position of its probe.)"""
        c = host_map.NATIVE.get()
        if c is not None:
            return host_map.insert(c, self.keys, self._bits(), self.none, ids)
        pos = torch.full_like(ids, -1)
        was = torch.full_like(ids, EMPTY)
        idx = torch.arange(ids.numel())
        q, p = ids, self._home(ids)
        end = self.none
        while idx.numel():
            if int(p.max()) >= end:
                placed = nonzero_1d(pos >= 0)
                self.keys.index_copy_(0, pos.index_select(0, placed), was.index_select(0, placed))
                return None, 0
            k = self.keys.index_select(0, p)
            free = nonzero_1d(k < 0)
            fp = p.index_select(0, free)
            was.index_copy_(0, idx.index_select(0, free), k.index_select(0, free))
            self.keys.index_put_((fp,), q.index_select(0, free))
            placed = free[self.keys.index_select(0, fp) == q.index_select(0, free)]
            pos.index_copy_(0, idx.index_select(0, placed), p.index_select(0, placed))
            going = torch.ones(idx.numel(), dtype=torch.bool)
            going[placed] = False
            going = nonzero_1d(going)
            idx, q, p = idx.index_select(0, going), q.index_select(0, going), p.index_select(0, going) + 1
        return pos, int((was == TOMB).sum())

    def _relayout(self, keep: torch.Tensor, size: int) -> None:
        """Lay the kept ids out afresh in one sort: sorted by home, each takes home + the keys stacked before it
        (linear probing's layout for that order). Pins go with their ids."""
        at = nonzero_1d(keep)
        ids, words, pinned = self.keys.index_select(0, at), self.words.index_select(0, at), self.pinned[at]
        size = _pow2_at_least(size)
        while True:
            self._allocate(size)
            home = self._home(ids)
            order = torch.argsort(home)
            h = home.index_select(0, order)
            i = torch.arange(h.numel())
            pos = i + torch.cummax(h - i, 0).values if h.numel() else h
            if not h.numel() or int(pos[-1]) < self.none:
                break
            size *= 2  # a run longer than the tail: spread out more
        self.keys.index_copy_(0, pos, ids.index_select(0, order))
        self.words.index_copy_(0, pos, words.index_select(0, order))
        self.pinned.index_copy_(0, pos, pinned.index_select(0, order))
        self.used = ids.numel()
        self.relayouts += 1
