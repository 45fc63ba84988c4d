"""The id map's and use bits' per-id loops in C (host_map.c), for the read-ahead thread.

The torch code of id_map.py / next_use.py makes ~10 passes over a batch's ~40k ids, each a random gather or
scatter over a map of millions of positions: ~8 ms a batch to enter, ~10 ms a window for the slots' next uses,
more than the step it runs beside on a small machine. The C loops make one pass per id (and hold no GIL). Used
where the package's C library is installed and on (kernels/native.py); the torch code is the reference, and the tests run
both (same answers; the map's internal positions may differ).
"""
from __future__ import annotations

import ctypes

import torch

from cachedemb.kernels.native import Helper

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
NATIVE = Helper("host_map", {
    "cemb_map_find": ([_P, _I64, _P, _I64, _P], None),
    "cemb_map_insert": ([_P, _I64, _I64, _P, _I64, _P, _P], _I64),
    "cemb_map_drop_empty": ([_P, _P, _P, _I64, _P, _I64], _I64),
    "cemb_bits_set": ([_P, _I64, _I64, _I64, _P, _I64], None),
    "cemb_bits_clear_drop": ([_P, _P, _P, _I64, _I64, _I64, _P, _I64], _I64),
    "cemb_first_in": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _P], None),
    "cemb_unused_in": ([_P, _I64, _P, _I64, _P, _P, _I64, _I64, _P], _I64),
    "cemb_fill_u8": ([_P, _P, _I64, _I64], None),
    "cemb_fill_i64": ([_P, _P, _I64, _I64], None),
    "cemb_track_slots": ([_P, _P, _P, _I64, _I64], _I64),
    "cemb_slide_pass": ([_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64], None),
    "cemb_changed": ([_P, _P, _I64, _P], _I64),
    "cemb_relative": ([_P, _I64, _I64, _P], None),
})


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _ids(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def find(c, keys: torch.Tensor, bits: int, ids: torch.Tensor) -> torch.Tensor:
    ids = _ids(ids)
    out = torch.empty_like(ids)
    c.cemb_map_find(_ptr(keys), bits, _ptr(ids), ids.numel(), _ptr(out))
    return out


def insert(c, keys: torch.Tensor, bits: int, none: int, ids: torch.Tensor):
    """(positions, TOMBs reused), or (None, 0) with the map unchanged if a probe would reach `none`."""
    ids = _ids(ids)
    out, was = torch.empty_like(ids), torch.empty_like(ids)
    reused = c.cemb_map_insert(_ptr(keys), bits, none, _ptr(ids), ids.numel(), _ptr(out), _ptr(was))
    return (None, 0) if reused < 0 else (out, int(reused))


def drop_empty(c, keys, words, pinned, pos: torch.Tensor) -> int:
    """Drop the empty ids at `pos` (TOMB, or EMPTY where a TOMB needs not stay); returns the positions made EMPTY."""
    pos = _ids(pos)
    return c.cemb_map_drop_empty(_ptr(keys), _ptr(words), _ptr(pinned), words.shape[1], _ptr(pos), pos.numel())


def bits_set(c, words, word: int, bit: int, pos: torch.Tensor) -> None:
    pos = _ids(pos)
    c.cemb_bits_set(_ptr(words), words.shape[1], word, bit, _ptr(pos), pos.numel())


def bits_clear_drop(c, keys, words, pinned, word: int, bit: int, pos: torch.Tensor) -> int:
    """Clear a bit at `pos`, then `drop_empty` there; returns the positions made EMPTY."""
    pos = _ids(pos)
    return c.cemb_bits_clear_drop(_ptr(keys), _ptr(words), _ptr(pinned), words.shape[1], word, bit, _ptr(pos),
                                  pos.numel())


def first_in(c, words, pos: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """segments: (word, mask, batch of bit 0) in batch order."""
    pos = _ids(pos)
    out = torch.empty_like(pos)
    seg = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3).t().contiguous()
    c.cemb_first_in(_ptr(words), words.shape[1], _ptr(pos), pos.numel(), _ptr(seg[0]), _ptr(seg[1]), _ptr(seg[2]),
                    seg.shape[1], _ptr(out))
    return out


def unused_in(c, words, pos: torch.Tensor, segments: list[tuple[int, int, int]], budget: int) -> torch.Tensor | None:
    """Indices of the positions with no bit in any segment (ascending), or None once more than `budget`."""
    pos = _ids(pos)
    out = torch.empty(min(pos.numel(), max(budget, 0)), dtype=torch.int64)
    seg = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3).t().contiguous()
    count = c.cemb_unused_in(_ptr(words), words.shape[1], _ptr(pos), pos.numel(), _ptr(seg[0]), _ptr(seg[1]),
                             seg.shape[1], max(budget, 0), _ptr(out))
    return None if count < 0 else out[:count]


def fill(c, target: torch.Tensor, pos: torch.Tensor, value: int) -> None:
    """target[pos] = value for a bool or int64 host tensor."""
    pos = _ids(pos)
    fn = c.cemb_fill_u8 if target.dtype == torch.bool else c.cemb_fill_i64
    fn(_ptr(target), _ptr(pos), pos.numel(), int(value))


def track_slots(c, slot_at: torch.Tensor, pos: torch.Tensor, changed: torch.Tensor, none: int) -> bool:
    pos, changed = _ids(pos), _ids(changed)
    return bool(c.cemb_track_slots(_ptr(slot_at), _ptr(pos), _ptr(changed), changed.numel(), none))


# the tests of `slide_pass`: recompute every entry; only those whose first use left the range (< lo); only those
# with no use in the last range (-1)
ALWAYS, LEFT_RANGE, NONE_YET = 0, 1, 2


def slide_pass(c, words, pos: torch.Tensor, uses: torch.Tensor, slot_at: torch.Tensor | None, entries: torch.Tensor,
               test: int, lo: int, segments: list[tuple[int, int, int]]) -> None:
    """uses[s] = the first use over `segments` of each slot s of `entries` (slots; map positions where `slot_at`
    is given, their slots found there) that passes `test` against its kept use, in place."""
    entries = _ids(entries)
    seg = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3).t().contiguous()
    at = 0 if slot_at is None else _ptr(slot_at)
    c.cemb_slide_pass(_ptr(words), words.shape[1], _ptr(pos), _ptr(uses), at, _ptr(entries), entries.numel(),
                      int(slot_at is not None), test, lo, _ptr(seg[0]), _ptr(seg[1]), _ptr(seg[2]), seg.shape[1])


def changed(c, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Indices where two int64 host tensors of one shape differ (ascending)."""
    a, b = _ids(a), _ids(b)
    out = torch.empty(a.numel(), dtype=torch.int64)
    return out[: c.cemb_changed(_ptr(a), _ptr(b), a.numel(), _ptr(out))]


def relative(c, uses: torch.Tensor, now: int) -> torch.Tensor:
    """uses - now where uses >= 0, else -1 (a new tensor)."""
    uses = _ids(uses)
    out = torch.empty(uses.numel(), dtype=torch.int64)
    c.cemb_relative(_ptr(uses), uses.numel(), now, _ptr(out))
    return out
