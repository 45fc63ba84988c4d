"""The victim pool's union with a window's slots in C (pool_native.c): O(pool + window) instead of a mask over the
whole cache.

With one-batch prefetch windows every window's ~40k slots join the pool when their protection comes off; the
torch union (a [C] mask, two fills and a nonzero) is ~1.5 ms a window at a 400k-slot cache, the C pass ~0.2 ms.
The union keeps the pool's order and appends the new slots; the pool's choice does not depend on its order
(scores are distinct). `enabled = False`, no compiler or a tensor off the CPU: the torch union.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from cachedemb.kernels.native import CFunctions

enabled = True  # False: the torch union (tests switch it)
_I64, _P = ctypes.c_int64, ctypes.c_void_p
_C = CFunctions(Path(__file__).with_name("pool_native.c"), {
    "cemb_pool_union": ([_P, _I64, _P, _I64, _I64, _P, _P], _I64),
})


def union(pool: torch.Tensor, slots: torch.Tensor, capacity: int, mark: torch.Tensor) -> torch.Tensor | None:
    """pool (distinct slots in [0, capacity)) followed by the slots of `slots` in [0, capacity) not in it, each
    once; `mark` ([capacity] bool, all False, left so). None where the C pass does not apply."""
    c = _C.get() if enabled else None
    if c is None or any(t.device.type != "cpu" for t in (pool, slots, mark)) or mark.numel() < capacity:
        return None
    pool, slots = pool.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    out = torch.empty(pool.numel() + slots.numel(), dtype=torch.int64)
    n = c.cemb_pool_union(pool.data_ptr(), pool.numel(), slots.data_ptr(), slots.numel(), capacity,
                          mark.data_ptr(), out.data_ptr())
    return out[:n]
