"""Row copies between CPU tensors in one C pass, for the torch path's row moves (admissions, write-backs).

On CPU a row copy through torch is a gather into scratch then a scatter (two passes over the rows), after two
masked selections of the pairs in range: for the ~20-40k rows a batch moves at a 1-2.5% cache that is ~2-3.5 ms
a batch on one core; one memcpy per row in C (`host_rows.c`, called through
ctypes without the GIL), skipping the pairs out of range itself, is about half. The torch code stays
the reference: without the C library (or with it off), or where the tensors do not fit the fast path
(another device or dtype, not contiguous, overlapping memory, an accumulating copy) it runs; the tests compare
both.
"""
from __future__ import annotations

import ctypes

import torch

from .native import Helper

_BUMP = getattr(torch.autograd.graph, "increment_version", None)
_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("host_rows", {"cemb_copy_rows": ([_P, _I64, _P, _P, _I64, _P, _I64, _I64], None)})


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def copy_rows(src2: torch.Tensor, src_idx: torch.Tensor, dst2: torch.Tensor, dst_idx: torch.Tensor, n) -> bool:
    """dst2[dst_idx[i]] = src2[src_idx[i]] for the first n pairs with both indices in range (2-D tensors, rows
    along dim 0), in one C pass. Returns False, having done nothing, where the fast path does not apply."""
    c = NATIVE.get()
    if (c is None or _BUMP is None or src2.device.type != "cpu" or dst2.device.type != "cpu"
            or src_idx.device.type != "cpu" or dst_idx.device.type != "cpu" or src2.dtype != dst2.dtype
            or src2.dim() != 2 or dst2.dim() != 2 or src2.shape[1] != dst2.shape[1]
            or not src2.is_contiguous() or not dst2.is_contiguous() or src2.is_conj() or dst2.is_conj()
            or src2.is_neg() or dst2.is_neg()):
        return False
    (a0, a1), (b0, b1) = _span(src2), _span(dst2)
    if a0 < b1 and b0 < a1:  # overlapping memory: the torch code's gather-then-scatter order matters
        return False
    m = min(int(n), src_idx.numel(), dst_idx.numel())
    if m <= 0:
        return True
    s = src_idx.reshape(-1)[:m].to(torch.int64).contiguous()
    d = dst_idx.reshape(-1)[:m].to(torch.int64).contiguous()
    c.cemb_copy_rows(a0, src2.shape[0], s.data_ptr(), b0, dst2.shape[0], d.data_ptr(), m,
                     src2.shape[1] * src2.element_size())
    _BUMP(dst2)
    return True
