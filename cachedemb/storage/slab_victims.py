"""The host cache's eviction candidates and keys (HostRowCache._evict) in one C pass over the slab.

An eviction ranks every row of the slab no batch in flight holds: in numpy that is ~8 passes over the slab's
arrays (masks, a gather of the counts, the key's shifts and clips), ~6 ms for a 500k-row slab, paid about once
a step at a 1/16 host cache. `slab_victims.c` builds the same candidates (ascending rows) and the same keys in
one pass, so the victims chosen from them are the same. The numpy code is the reference: it runs without
the C library (or with it off), or where the arrays are not what the loop reads; the tests compare both.
"""
from __future__ import annotations

import ctypes

import numpy as np

from cachedemb.kernels.native import Helper

_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("slab_victims", {
    "cemb_slab_victim_keys": ([_P, _P, _P, _P, _I64, _I64, _P, _I64, _P, _P, _P], _I64),
})

_FREQ_MAX = (1 << 40) - 1
_STEP_MAX = (1 << 22) - 1


def victim_keys_numpy(row_id: np.ndarray, row_step: np.ndarray, next_use: np.ndarray, freq: np.ndarray,
                      done_below: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference: (candidate rows ascending, their keys); see slab_victims.c for the key."""
    held = row_step >= done_below
    cand_mask = (row_id >= 0) & ~held
    cand_mask[keep] = False
    cand = np.flatnonzero(cand_mask)
    key = (np.minimum(freq[cand], _FREQ_MAX) << 22) | np.clip(row_step[cand] + 1, 0, _STEP_MAX)
    # Look-ahead (under prefetch): rows a batch of the horizon reads go last.
    key |= (next_use[cand] >= done_below).astype(np.int64) << 62
    return cand, key


def _fits(*arrays: np.ndarray) -> bool:
    return all(a.dtype == np.int64 and a.ndim == 1 and a.flags.c_contiguous for a in arrays)


def victim_keys(row_id: np.ndarray, row_step: np.ndarray, next_use: np.ndarray, freq: np.ndarray,
                done_below: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(candidate rows ascending, their keys): rows cached, not held by a batch in flight, not in `keep`."""
    n = row_id.size
    c = NATIVE.get()
    keep = np.ascontiguousarray(keep, dtype=np.int64).reshape(-1)
    if (c is None or not _fits(row_id, row_step, next_use, freq) or row_step.size < n or next_use.size < n
            or freq.size < n or (keep.size and (keep.min() < 0 or keep.max() >= n))):
        return victim_keys_numpy(row_id, row_step[:n], next_use[:n], freq[:n], done_below, keep)
    cand, key = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    scratch = np.zeros(n, dtype=np.uint8)
    count = c.cemb_slab_victim_keys(row_id.ctypes.data, row_step.ctypes.data, next_use.ctypes.data,
                                    freq.ctypes.data, n, int(done_below), keep.ctypes.data, keep.size,
                                    scratch.ctypes.data, cand.ctypes.data, key.ctypes.data)
    return cand[:count], key[:count]
