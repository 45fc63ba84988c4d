"""The CPU cache's placement bookkeeping in C (place_native.c): the torch ops of EmbeddingCache._place, per id.

On the host-count path (CPU) `_place` classifies a batch's distinct ids, protects the hits, places the misses
and updates the map and slot metadata in ~30 torch ops over the batch's ids (each a full pass, most a gather
or scatter): ~6 ms a batch of 40k distinct ids on one core, ~20 ms a prefetch window of 120k, a fifth of a
CPU training step. The two C loops do the same writes in the same order (masked scatters into the dump element
included), so the state is the same bit for bit; the victim choice between them stays in torch (the policy is
the user's). Used where the package's C library is installed and on (kernels/native.py); the torch code of `_place` is
the reference, and the tests run both.
"""
from __future__ import annotations

import ctypes

import torch

from cachedemb.kernels.native import Helper

_BUMP = getattr(torch.autograd.graph, "increment_version", None)
_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("place_native", {
    "cemb_place_find": ([_P, _I64, _I64, _P, _I64, _P, _P, _P, _P, _P], None),
    "cemb_place_commit": ([_P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64,
                           _P, _P, _P, _P, _P, _P, _P], None),
    "cemb_count_uses": ([_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64], _I64),
    "cemb_set_protection": ([_P, _P, _I64, _I64, _I64], _I64),
})


def _p(t: torch.Tensor) -> int:
    return t.data_ptr()


_LAYOUT = (torch.int32, torch.bool, torch.int64, torch.bool, torch.int64)


def fits(id_slot, protected, slot_ids, dirty, last_use) -> bool:
    """Whether the cache's tensors are what the C loops read and write (CPU, these dtypes, contiguous)."""
    return all(t is not None and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
               for t, dtype in zip((id_slot, protected, slot_ids, dirty, last_use), _LAYOUT))


class Found:
    """A batch's hits and misses (find), for the victim choice and the commit."""

    def __init__(self, uniq, n_uniq: int, slot, hit_slots, was, n_hit: int, n_miss: int, n_newly: int):
        self.uniq, self.n_uniq = uniq, n_uniq
        self.slot, self.hit_slots, self.was = slot, hit_slots, was
        self.n_hit, self.n_miss, self.n_newly = n_hit, n_miss, n_newly


def find(c, uniq: torch.Tensor, n_uniq: int, id_slot: torch.Tensor, capacity: int,
         protected: torch.Tensor) -> Found | None:
    """Classify uniq[:n_uniq] through the map and protect the hits' slots (protected[capacity] is the dump).
    None, with nothing changed, where an id is outside the map (the torch code then raises as it does)."""
    uniq = uniq.to(torch.int64).contiguous()
    cap = uniq.numel()
    n_uniq = max(0, min(n_uniq, cap))
    if n_uniq and int(uniq[:n_uniq].max()) >= id_slot.numel():
        return None
    slot, hit_slots = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.int64)
    was = torch.empty(cap, dtype=torch.bool)
    counts = torch.zeros(3, dtype=torch.int64)
    c.cemb_place_find(_p(uniq), cap, n_uniq, _p(id_slot), capacity, _p(protected), _p(slot), _p(hit_slots),
                      _p(was), _p(counts))
    n_hit, n_miss, n_newly = counts.tolist()
    return Found(uniq, n_uniq, slot, hit_slots, was, n_hit, n_miss, n_newly)


def commit(c, f: Found, protected, victims, n_admit: int, capacity: int, id_slot, slot_ids, dirty, last_use,
           batch: int):
    """Restore the protection, place the misses, update the map and slot metadata. Returns (loc_u, old_ids,
    dirty_ids, miss_ids, miss_dest, evicted, written); the move tensors are None without victims."""
    cap = f.uniq.numel()
    k = 0 if victims is None else victims.numel()
    victims = torch.empty(0, dtype=torch.int64) if victims is None else victims.to(torch.int64).contiguous()
    if k and not (0 <= int(victims.min()) and int(victims.max()) < capacity):
        raise IndexError(f"victim slots must lie in [0, {capacity}), got [{int(victims.min())}, "
                         f"{int(victims.max())}]")
    loc_u, dest = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.int64)
    old_ids, dirty_ids = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=torch.int64)
    miss_ids = torch.empty(cap + 1 if k else 0, dtype=torch.int64)
    miss_dest = torch.empty(cap + 1 if k else 0, dtype=torch.int64)
    counts = torch.zeros(2, dtype=torch.int64)
    c.cemb_place_commit(_p(f.uniq), cap, f.n_uniq, _p(f.slot), _p(f.hit_slots), _p(f.was), _p(protected),
                        _p(victims), k, n_admit, f.n_miss, capacity, _p(id_slot), _p(slot_ids), _p(dirty),
                        _p(last_use), batch, _p(loc_u), _p(dest), _p(old_ids), _p(dirty_ids), _p(miss_ids),
                        _p(miss_dest), _p(counts))
    if _BUMP is not None:  # as the torch code's in-place ops do
        for t in (protected, id_slot, slot_ids, dirty, last_use):
            _BUMP(t)
    evicted, written = counts.tolist()
    if not k:
        return loc_u, None, None, None, None, 0, 0
    return loc_u, old_ids, dirty_ids, miss_ids, miss_dest, evicted, written


def count_uses(c, loc_u, live, counts, inverse, dump: int, batch: int, slot_freq, last_use, host_freq,
               train: bool) -> torch.Tensor | None:
    """prepare's use counts in one pass (see cemb_count_uses): the batch's real lookups as a [1] tensor, or None,
    with nothing changed, where a tensor is not what the loop reads (the torch code then runs)."""
    ints = (loc_u, counts, inverse, slot_freq, last_use, host_freq)
    if not (live.dtype == torch.bool and all(t.dtype == torch.int64 for t in ints)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in (live, *ints))
            and loc_u.numel() == live.numel() == counts.numel()):
        return None
    lookups = c.cemb_count_uses(_p(loc_u), _p(live), _p(counts), loc_u.numel(), dump, batch, _p(slot_freq),
                                _p(last_use), _p(host_freq), host_freq.numel(), _p(inverse), inverse.numel(),
                                int(train))
    if train and _BUMP is not None:
        for t in (slot_freq, last_use, host_freq):
            _BUMP(t)
    return torch.tensor([lookups], dtype=torch.int64)


def set_protection(c, protected: torch.Tensor, loc: torch.Tensor, capacity: int, value: bool) -> int | None:
    """protected[slot of each loc] = value (host locations to the dump element `capacity`); how many resident
    slots changed. None (nothing done) where the tensors are not the host-count path's."""
    if protected.device.type != "cpu" or protected.dtype != torch.bool or not protected.is_contiguous() \
            or protected.numel() < capacity + 1 or loc.device.type != "cpu":
        return None
    loc = loc.to(torch.int64).contiguous()
    changed = c.cemb_set_protection(_p(protected), _p(loc), loc.numel(), capacity, int(value))
    if _BUMP is not None:  # as the torch code's in-place index_fill_ does
        _BUMP(protected)
    return changed
