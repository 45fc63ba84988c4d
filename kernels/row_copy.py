"""Row gather/scatter between the host table and the device cache (admission and write-back).

One op serves both directions: `dst[dst_idx[i]] = src[src_idx[i]]` for i < n where both indices are >= 0.
A negative index skips the row (a clean victim, an unused buffer position), so callers pass fixed-capacity
buffers with a device-side count and never compact on the host. 1-D tensors are treated as [R, 1].
"""
from __future__ import annotations

import torch

from .dispatch import backend_for


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1) if t.dim() == 1 else t


def row_copy_torch(src, src_idx, dst, dst_idx, n):
    """Reference: boolean selection then index_copy (syncs on the host; fine for a reference)."""
    src2, dst2 = _as_rows(src), _as_rows(dst)
    m = min(int(n), src_idx.numel())
    s, d = src_idx[:m], dst_idx[:m]
    sel = (s >= 0) & (d >= 0)
    s, d = s[sel], d[sel]
    if s.numel() == 0:
        return
    rows = src2.index_select(0, s.to(src2.device))
    dst2.index_copy_(0, d.to(dst2.device), rows.to(device=dst2.device, dtype=dst2.dtype))


def row_copy(src, src_idx, dst, dst_idx, n):
    """Copy rows src -> dst. `n` is an int or a [1] tensor on the index device."""
    index_device = src_idx.device
    if backend_for(index_device) == "triton":
        return row_copy_triton(src, src_idx, dst, dst_idx, n)
    return row_copy_torch(src, src_idx, dst, dst_idx, n)
