"""The victim pool's bookkeeping in C (pool_native.c): O(pool + joining slots) passes instead of masks over the
whole cache and torch ops over the pool.

With one-batch prefetch windows every window's ~40k slots join the pool when their protection comes off; the
torch union (a [C] mask, two fills and a nonzero) is ~1.5 ms a window at a 400k-slot cache, the C pass ~0.2 ms.
The union keeps the pool's order and appends the new slots; the pool's choice does not depend on its order
(scores are distinct). `rescore` does a choice's union, scores (slot_score.h, the built-in policies), valid count
and pruning in one pass: at a 5% cache with one-batch windows (a ~130k-slot pool) the separate steps (union,
protection gather, scores, count, prune) took ~4.5 ms a window. The C library missing or off (kernels/native.py), or a
tensor off the CPU: the torch union and the caller's separate steps.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from cachedemb.cache.policy import score_kernel
from cachedemb.kernels.native import Helper

_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("pool_native", {
    "cemb_pool_union": ([_P, _I64, _P, _I64, _I64, _P, _P], _I64),
    "cemb_pool_rescore": ([_I64, _P, _I64, _P, _I64, _I64] + [_P] * 5 + [_I64, _I64] + [_P] * 6, None),
})


def kind(policy) -> int | None:
    """`policy`'s kind for the C re-scoring (slot_score.h: kernels/slot_score.py's SCORE_* kinds), or None: the
    caller's separate steps score with the policy (a user's policy, or the C library missing or off)."""
    kind = score_kernel(policy)
    return kind if kind is not None and NATIVE.get() is not None else None


def union(pool: torch.Tensor, slots: torch.Tensor, capacity: int, mark: torch.Tensor) -> torch.Tensor | None:
    """pool (distinct slots in [0, capacity)) followed by the slots of `slots` in [0, capacity) not in it, each
    once; `mark` ([capacity] bool, all False, left so). None where the C pass does not apply."""
    c = NATIVE.get()
    if c is None or any(t.device.type != "cpu" for t in (pool, slots, mark)) or mark.numel() < capacity:
        return None
    pool, slots = pool.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    out = torch.empty(pool.numel() + slots.numel(), dtype=torch.int64)
    n = c.cemb_pool_union(pool.data_ptr(), pool.numel(), slots.data_ptr(), slots.numel(), capacity,
                          mark.data_ptr(), out.data_ptr())
    return out[:n]


class Rescored(NamedTuple):
    """A choice's pool: the union's slots and scores, the entries that stay (score <= bound, or PROTECTED unless
    dropped) and their scores, and how many of them are valid victims (score <= bound, not PROTECTED)."""
    union: torch.Tensor
    score: torch.Tensor
    kept: torch.Tensor
    kept_score: torch.Tensor
    n_valid: int


def rescore(kind: int, pool: torch.Tensor, joined: torch.Tensor, capacity: int, slot_ids: torch.Tensor,
            freq: torch.Tensor, last_use: torch.Tensor, next_use: torch.Tensor, protected: torch.Tensor, bound: int,
            mark: torch.Tensor, scratch: torch.Tensor | None = None, drop_protected: bool = False) -> Rescored | None:
    """The pool (distinct slots in [0, capacity)) joined by `joined` (slots in [0, capacity) count, each once),
    scored under a built-in policy `kind` (kernels/slot_score.py) and `protected` (a bool per slot), and pruned
    against `bound`. None where the C pass does not apply. `scratch`: an int64 [4, >= len(pool) + len(joined)]
    buffer for the union and scores (views of it come back, valid until its next use; the kept entries are
    copies): a caller re-scoring every batch keeps one instead of faulting in megabytes of fresh pages each
    time. `drop_protected`: protected entries leave the pool (VictimPool.choose says when that stays exact)."""
    c = NATIVE.get()
    if c is None or kind is None:
        return None
    for t in (pool, joined, slot_ids, freq, last_use, next_use, protected, mark):
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
    for t in (slot_ids, freq, last_use, next_use):
        if t.dtype != torch.int64 or t.numel() < capacity:
            return None
    if protected.dtype != torch.bool or protected.numel() < capacity or mark.numel() < capacity:
        return None
    pool, joined = pool.to(torch.int64), joined.to(torch.int64)
    n = pool.numel() + joined.numel()
    if scratch is None or scratch.dtype != torch.int64 or scratch.dim() != 2 or scratch.shape[0] != 4 \
            or scratch.shape[1] < n or not scratch.is_contiguous() or scratch.device.type != "cpu":
        scratch = torch.empty(4, n, dtype=torch.int64)
    union, score, kept, kept_score = scratch
    counts = torch.zeros(3, dtype=torch.int64)
    c.cemb_pool_rescore(kind, pool.data_ptr(), pool.numel(), joined.data_ptr(), joined.numel(), capacity,
                        slot_ids.data_ptr(), freq.data_ptr(), last_use.data_ptr(), next_use.data_ptr(),
                        protected.data_ptr(), bound, int(drop_protected), mark.data_ptr(), union.data_ptr(),
                        score.data_ptr(), kept.data_ptr(), kept_score.data_ptr(), counts.data_ptr())
    n_union, n_kept, n_valid = counts.tolist()
    return Rescored(union[:n_union], score[:n_union], kept[:n_kept].clone(), kept_score[:n_kept], n_valid)
