"""Pooled forward (sum / mean / max) over cache rows.

Inputs for B lookups in `bags` bags: `rows [R, D]` (cache rows, fp32/bf16/fp16), `loc_u [U]` (the row of each
unique id), `inverse [B]` (each lookup's unique position; -1 = padding lookup, excluded from pooling and from
the mean's count), `offsets [bags + 1]` (bag b is lookups offsets[b]:offsets[b+1]; offsets[-1] == B),
`per_sample_weights [B]` (sum mode only). Accumulation is fp32; the output has rows' dtype.
Max mode also returns `max_pos [bags, D]`: the lookup position holding each element's maximum (first one on
ties, as torch), -1 for a bag with no non-padding lookup, whose output is 0.
"""
from __future__ import annotations

import torch

from .dispatch import backend_for

MODE_SUM, MODE_MEAN, MODE_MAX = 0, 1, 2
MODES = {"sum": MODE_SUM, "mean": MODE_MEAN, "max": MODE_MAX}


def pooled_forward_torch(rows, loc_u, inverse, offsets, mode: int, per_sample_weights=None):
    """Reference: gather the rows each lookup reads, then torch.embedding_bag with an appended zero pad row."""
    n_lookups = inverse.numel()
    valid = inverse >= 0
    lookup_rows = loc_u[inverse.clamp(min=0)]
    gathered = rows.index_select(0, lookup_rows.to(rows.device)).float()
    table = torch.cat([gathered, gathered.new_zeros(1, rows.shape[1])])
    positions = torch.arange(n_lookups, device=inverse.device)
    idx = torch.where(valid, positions, torch.full_like(positions, n_lookups)).to(rows.device)
    psw = per_sample_weights.float() if per_sample_weights is not None else None
    out, _, bag_size, max_idx = torch.embedding_bag(
        table, idx, offsets[:-1].to(rows.device), False, mode, False, psw, False, n_lookups
    )
    out = out.to(rows.dtype)
    if mode != MODE_MAX:
        return out, None
    empty = (bag_size == 0).unsqueeze(1)
    max_pos = torch.where(empty, torch.full_like(max_idx, -1), max_idx)
    return out, max_pos


def pooled_forward(rows, loc_u, inverse, offsets, mode: int, per_sample_weights=None):
    if backend_for(rows.device) == "triton":
        return pooled_forward_triton(rows, loc_u, inverse, offsets, mode, per_sample_weights)
    return pooled_forward_torch(rows, loc_u, inverse, offsets, mode, per_sample_weights)
