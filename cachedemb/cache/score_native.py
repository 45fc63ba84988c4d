"""The built-in policies' slot scores on CPU in one C pass (score_native.c), and the look-ahead's next uses.

Choosing victims re-scores the candidate pool every batch with misses (tens of thousands of slots, the whole
cache at a small one): the view's four gathers and the policy's ~10 elementwise ops are ~3-4 ms a batch on one
core at an 80k-slot cache. The C loop reads each slot's metadata once and computes the same int64 scores as
cachedemb/cache/policy.py (which stays the reference: a user's policy, a multi-table cache, another device, no
C library missing or off (kernels/native.py) all score through the policy). The Triton backend has its own kernel
(kernels/slot_score.py).
"""
from __future__ import annotations

import ctypes

import torch

from cachedemb.cache.policy import score_kernel
from cachedemb.kernels.native import Helper

_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("score_native", {
    "cemb_slot_score": ([_I64, _P, _I64, _I64] + [_P] * 6, None),
    "cemb_next_use": ([_P] * 3 + [_I64] + [_P], None),
})


def kind(policy) -> int | None:
    """`policy`'s kind for the C passes (score_native.c, pool_native.c's re-scoring), or None: score with the policy
    (a user's policy, or the C scores switched off)."""
    kind = score_kernel(policy)
    return kind if kind is not None and NATIVE.get() is not None else None


def score(policy, slots: torch.Tensor | None, protected: torch.Tensor, capacity: int, slot_ids: torch.Tensor,
          freq: torch.Tensor, last_use: torch.Tensor, next_use: torch.Tensor) -> torch.Tensor | None:
    """Scores of `slots` (None: all `capacity` slots) under per-entry `protected`, or None where the C loop does
    not apply (the caller scores with the policy)."""
    kind = score_kernel(policy)  # kernels/slot_score.py's SCORE_* kinds, which score_native.c takes too
    c = NATIVE.get() if kind is not None else None
    if c is None or protected.device.type != "cpu" or protected.dtype != torch.bool:
        return None
    n = capacity if slots is None else slots.numel()
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
        if n and not (0 <= int(slots.min()) and int(slots.max()) < capacity):
            return None  # the policy's view raises (or scores) as it does
    protected = protected.contiguous()
    for t in (slot_ids, freq, last_use, next_use):
        if t.device.type != "cpu" or t.dtype != torch.int64 or not t.is_contiguous() or t.numel() < capacity:
            return None
    if protected.numel() != n:
        return None
    out = torch.empty(n, dtype=torch.int64)
    c.cemb_slot_score(kind, None if slots is None else slots.data_ptr(), n, capacity, slot_ids.data_ptr(),
                      freq.data_ptr(), last_use.data_ptr(), next_use.data_ptr(), protected.data_ptr(), out.data_ptr())
    return out


def next_use(slot_ids: torch.Tensor, ids: torch.Tensor, uses: torch.Tensor) -> torch.Tensor | None:
    """Each slot's batches to its next use as the snapshot `ids` had it (`uses`), -1 where none is known or the
    slot's id changed since; None where the C loop does not apply."""
    c = NATIVE.get()
    n = uses.numel()
    if c is None or any(t.device.type != "cpu" or t.dtype != torch.int64 for t in (slot_ids, ids, uses)):
        return None
    slot_ids, ids, uses = slot_ids[:n].contiguous(), ids.contiguous(), uses.contiguous()
    if ids.numel() != n or slot_ids.numel() != n:
        return None
    out = torch.empty(n, dtype=torch.int64)
    c.cemb_next_use(slot_ids.data_ptr(), ids.data_ptr(), uses.data_ptr(), n, out.data_ptr())
    return out
