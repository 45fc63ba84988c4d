"""A stable sort of host integer keys with its permutation, several times faster than `torch.sort` on CPU.

Every CPU batch sorts its ids once (distinct ids, inverse, lookup groups), and the prefetch read-ahead sorts each
batch it reads. Each key is packed with its position, `(key - low) << bits | position`, so all packed keys are
distinct and any sort of them is the stable sort of the keys: the permutation is the low bits, the key the high
ones. The packed keys are sorted by an LSD radix sort over the key's bits in C (`host_sort.c`, no GIL): 106k keys of
a 8M-row table (23 bits, two passes) take ~0.5 ms on one core, where numpy's comparison sort of the packed keys took
4.1 ms and `torch.sort(stable=True)` 1.7 ms on the same 2-core EPYC box (numpy's vectorized sort is fast only where
its SIMD dispatch applies: ~0.6 ms on the box this was first measured on). Without the C library (or with it off),
or for keys spanning more than 48 bits, numpy sorts the packed keys; where those would not fit in 63 bits (raw
64-bit ids), or on a device, `torch.sort` is used: the same result every way (the tests compare them).
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from .native import Helper

RADIX_MIN = 256  # fewer keys: numpy's sort (the radix passes' fixed cost is ~4k bins each)
_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("host_sort", {"cemb_radix_sort": ([_P, _I64, _I64, _I64, _I64, _P, _P], ctypes.c_int)})


def _radix(keys: torch.Tensor, low: int, high: int, bits: int):
    """(values, perm) by the C radix sort, or None where it does not apply."""
    n = keys.numel()
    kbits = (high - low).bit_length()
    c = NATIVE.get() if n >= RADIX_MIN and kbits <= 48 else None
    if c is None:
        return None
    src = keys.to(torch.int64).contiguous()
    values = torch.empty(n, dtype=torch.int64)
    perm = torch.empty(n, dtype=torch.int64)
    if not c.cemb_radix_sort(src.data_ptr(), n, low, kbits, bits, values.data_ptr(), perm.data_ptr()):
        return None
    return values.to(keys.dtype), perm


def _packable(low: int, high: int, bits: int) -> bool:
    return high - low < (1 << (63 - bits))


def stable_sort(keys: torch.Tensor, bounds: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted keys, int64 permutation) of a 1-D integer tensor, as `torch.sort(keys, stable=True)` returns.
    `bounds`: (low, high) with low <= every key <= high, when the caller knows them (spares a min/max pass)."""
    n = keys.numel()
    if keys.device.type != "cpu" or keys.dtype not in (torch.int64, torch.int32) or keys.dim() != 1 or n < 2:
        return torch.sort(keys, stable=True)
    if bounds is None:
        low, high = int(keys.min()), int(keys.max())
    else:
        low, high = bounds
    bits = max(1, (n - 1).bit_length())
    if low < -(1 << 62) or high >= (1 << 62) or not _packable(low, high, bits):
        return torch.sort(keys, stable=True)
    fast = _radix(keys, low, high, bits)
    if fast is not None:
        return fast
    packed = keys.to(torch.int64)
    if low:
        packed = packed - low
    packed = (packed << bits) | torch.arange(n, dtype=torch.int64)
    out = np.sort(packed.numpy())  # distinct keys: quicksort's order is the stable order
    packed = torch.from_numpy(out)
    perm = packed & ((1 << bits) - 1)
    values = packed >> bits
    if low:
        values += low
    return values.to(keys.dtype), perm


def unique_of_sort(keys: torch.Tensor, perm: torch.Tensor, counts: bool = False):
    """(ascending distinct keys, inverse[, counts]) from a stable sort's (sorted keys, permutation): runs by
    `unique_consecutive`, each original position's index among the distinct keys scattered back through the
    permutation. The answer of `torch.unique(..., return_inverse=True[, return_counts=True])`, without a sort."""
    out = torch.unique_consecutive(keys, return_inverse=True, return_counts=counts)
    inverse = torch.empty_like(out[1]).scatter_(0, perm, out[1])
    return (out[0], inverse, out[2]) if counts else (out[0], inverse)
