"""The exact id index of dynamic ids (cachedemb.dynamic): int64 id -> entry, vectorised open addressing whose
home slot is a full-avalanche hash (splitmix64's finalizer), so ids built to collide in their low bits spread
like any others."""
from __future__ import annotations

import torch

_M64 = (1 << 64) - 1


def _i64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    value &= _M64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_HASH_SALT = _i64(0x5851F42D4C957F2D)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits (wrapping arithmetic): a bijection with full avalanche."""
    x = x ^ _lsr(x, 30)
    x = x * _MIX1
    x = x ^ _lsr(x, 27)
    x = x * _MIX2
    return x ^ _lsr(x, 31)


class IdIndex:
    """Exact map int64 id -> entry slot: linear probing over a power-of-two table, vectorised (one probe
    distance per round for every pending key), at most half full counting tombstones. Every int64 is a key
    (occupancy is a separate state array). The home slot is mix64(id ^ salt), so multiples of 2^32 or ids equal
    in their low bits spread like any others; an insert displaced more than `max_probe` slots grows the table.

    Per slot: key, state (0 empty, 1 live, 2 tombstone) and the payload `row` (-1: not admitted), `count`,
    `last` (the step the id was last seen). `version` changes whenever slots move (rehash)."""

    EMPTY, LIVE, TOMB = 0, 1, 2

    def __init__(self, size: int = 1024, max_probe: int = 64):
        self.max_probe = max_probe
        self.version = 0
        self._alloc(max(16, 1 << (int(size) - 1).bit_length()))

    def _alloc(self, size: int) -> None:
        self.size, self.mask = size, size - 1
        self.keys = torch.zeros(size, dtype=torch.int64)
        self.state = torch.zeros(size, dtype=torch.int8)
        self.row = torch.full((size,), -1, dtype=torch.int64)
        self.count = torch.zeros(size, dtype=torch.int64)
        self.last = torch.zeros(size, dtype=torch.int64)
        self.live = self.used = 0  # live slots; live + tombstones
        self.max_disp = 0  # longest displacement of any key since the last rehash

    def home(self, keys: torch.Tensor) -> torch.Tensor:
        return mix64(keys ^ _HASH_SALT) & self.mask

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, -1 if absent. At most max_disp + 1 rounds; a round carries only the keys still
        probing (their position in `keys`, home slot and key), gathered with index_select."""
        result = torch.full_like(keys, -1)
        idx, home, want = None, self.home(keys), keys  # idx None: every key, in order
        for dist in range(self.max_disp + 1):
            pos = (home + dist).bitwise_and_(self.mask) if dist else home
            state = self.state.index_select(0, pos)
            hit = (state == self.LIVE).logical_and_(self.keys.index_select(0, pos) == want)
            h = hit.nonzero().squeeze(1)
            result.index_copy_(0, h if idx is None else idx.index_select(0, h), pos.index_select(0, h))
            go = hit.logical_or_(state == self.EMPTY).logical_not_().nonzero().squeeze(1)
            if go.numel() == 0:
                break
            idx = go if idx is None else idx.index_select(0, go)
            home, want = home.index_select(0, go), want.index_select(0, go)
        return result

    def reserve(self, extra: int) -> None:
        """Room for `extra` more keys without passing half full (tombstones count); rehash if not."""
        if 2 * (self.used + extra) <= self.size:
            return
        size = self.size
        while 4 * (self.live + extra) > size:
            size *= 2
        self._rehash(size)

    def insert(self, keys: torch.Tensor) -> torch.Tensor:
        """Insert distinct absent keys (payload row -1, count 0, last 0); returns their slots. May rehash."""
        self.reserve(keys.numel())
        while True:
            slots = self._try_insert(keys)
            if slots is not None:
                return slots
            self._rehash(self.size * 2)

    def _try_insert(self, keys: torch.Tensor) -> torch.Tensor | None:
        n = keys.numel()
        slots = torch.full_like(keys, -1)
        idx, home = torch.arange(n), self.home(keys)  # the keys still probing, in ascending position
        placed_all = []
        for dist in range(self.max_probe):
            if idx.numel() == 0:
                break
            pos = (home + dist).bitwise_and_(self.mask)
            state = self.state.index_select(0, pos)
            free = (state != self.LIVE).nonzero().squeeze(1)
            if free.numel():
                cand, cpos = idx.index_select(0, free), pos.index_select(0, free)
                # Several keys may reach one free slot in the same round: the lowest key position wins.
                uniq_pos, inv = torch.unique(cpos, return_inverse=True)
                if uniq_pos.numel() < cpos.numel():
                    winner = torch.full((uniq_pos.numel(),), n, dtype=torch.int64).scatter_reduce_(
                        0, inv, cand, "amin")
                    won = (cand == winner.index_select(0, inv)).nonzero().squeeze(1)
                    free, cand, cpos = free.index_select(0, won), cand.index_select(0, won), cpos.index_select(0, won)
                self.used += int((state.index_select(0, free) == self.EMPTY).sum())
                self.keys.index_copy_(0, cpos, keys.index_select(0, cand))
                self.state.index_fill_(0, cpos, self.LIVE)
                self.row.index_fill_(0, cpos, -1)
                self.count.index_fill_(0, cpos, 0)
                self.last.index_fill_(0, cpos, 0)
                slots.index_copy_(0, cand, cpos)
                placed_all.append(cand)
                self.live += cand.numel()
                self.max_disp = max(self.max_disp, dist)
                keep = torch.ones(idx.numel(), dtype=torch.bool).index_fill_(0, free, False).nonzero().squeeze(1)
                idx, home = idx.index_select(0, keep), home.index_select(0, keep)
        if idx.numel():
            # Undo this call's inserts (keys stay absent), the caller grows the table and retries.
            placed = torch.cat(placed_all) if placed_all else idx[:0]
            self.remove(slots[placed])
            return None
        return slots

    def remove(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        self.state[slots] = self.TOMB
        self.row[slots] = -1
        self.live -= slots.numel()

    def live_slots(self) -> torch.Tensor:
        return torch.nonzero(self.state == self.LIVE).reshape(-1)

    def _rehash(self, size: int) -> None:
        live = self.live_slots()
        keys, row, count, last = self.keys[live], self.row[live], self.count[live], self.last[live]
        while True:
            self._alloc(size)
            slots = self._try_insert(keys)
            if slots is not None:
                break
            size *= 2
        self.row[slots], self.count[slots], self.last[slots] = row, count, last
        self.version += 1
