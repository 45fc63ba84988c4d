"""The exact id index of dynamic ids (cachedemb.dynamic): int64 id -> entry, vectorised open addressing whose
home slot is a full-avalanche hash (splitmix64's finalizer), so ids built to collide in their low bits spread
like any others."""
from __future__ import annotations

import numpy as np
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
        probing (their position in `keys`, home slot and key). The rounds run on numpy views of the host
        arrays: a round is a dozen small ops, whose per-call cost in numpy is a fraction of torch's."""
        want = keys.contiguous().numpy()
        state, table = self.state.numpy(), self.keys.numpy()
        result = np.full(want.size, -1, dtype=np.int64)
        idx, home = None, self.home(keys).numpy()  # idx None: every key, in order
        for dist in range(self.max_disp + 1):
            pos = (home + dist) & self.mask if dist else home
            at = state[pos]
            hit = (at == self.LIVE) & (table[pos] == want)
            h = np.flatnonzero(hit)
            result[h if idx is None else idx[h]] = pos[h]
            go = np.flatnonzero(~hit & (at != self.EMPTY))
            if go.size == 0:
                break
            idx = go if idx is None else idx[go]
            home, want = home[go], want[go]
        return torch.from_numpy(result)

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
        """One round per probe distance, every key still probing at once (numpy views, as lookup)."""
        new = keys.contiguous().numpy()
        state, table = self.state.numpy(), self.keys.numpy()
        row, count, last = self.row.numpy(), self.count.numpy(), self.last.numpy()
        slots = np.full(new.size, -1, dtype=np.int64)
        idx, home = np.arange(new.size), self.home(keys).numpy()  # the keys still probing, in ascending position
        placed_all = []
        for dist in range(self.max_probe):
            if idx.size == 0:
                break
            pos = (home + dist) & self.mask
            at = state[pos]
            free = np.flatnonzero(at != self.LIVE)
            if free.size:
                # Several keys may reach one free slot in the same round: the lowest key position wins (the
                # first of its run in a stable sort, candidates being in ascending position).
                order = np.argsort(pos[free], kind="stable")
                ordered = pos[free][order]
                again = ordered[1:] == ordered[:-1]
                if again.any():
                    free = np.sort(free[order[np.concatenate(([True], ~again))]])
                cand, cpos = idx[free], pos[free]
                self.used += int(np.count_nonzero(at[free] == self.EMPTY))
                table[cpos] = new[cand]
                state[cpos] = self.LIVE
                row[cpos], count[cpos], last[cpos] = -1, 0, 0
                slots[cand] = cpos
                placed_all.append(cand)
                self.live += cand.size
                self.max_disp = max(self.max_disp, dist)
                keep = np.ones(idx.size, dtype=bool)
                keep[free] = False
                idx, home = idx[keep], home[keep]
        if idx.size:
            # Undo this call's inserts (keys stay absent), the caller grows the table and retries.
            placed = np.concatenate(placed_all) if placed_all else idx[:0]
            self.remove(torch.from_numpy(slots[placed]))
            return None
        return torch.from_numpy(slots)

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
