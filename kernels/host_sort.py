"""A stable sort of host integer keys with its permutation, faster than `torch.sort(stable=True)` on CPU.

Every CPU batch sorts its ids once (distinct ids, inverse, lookup groups), and the prefetch read-ahead sorts each
batch it reads. Each key is packed with its position, `(key - low) << bits | position`, so all packed keys are
distinct and any sort of them is the stable sort of the keys: the permutation is the low bits, the key the high
ones; numpy sorts the packed keys (distinct, so its quicksort's order is the stable one). A C radix sort of
them was measured against this and dropped: about 1 ms a sort of 106k ids saved, under 5% of a CPU step
(benchmarks/results/native_helpers_cpu.json). For keys spanning more than 62 bits with their positions (raw
64-bit ids), or on a device, `torch.sort` is used: the same result every way (the tests compare them).
"""
from __future__ import annotations

import numpy as np
import torch


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
