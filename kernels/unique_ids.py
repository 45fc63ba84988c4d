"""Per-batch unique ids with inverse and counts, into fixed-capacity buffers.

Shapes for a batch of B lookups: `uniq [B]` (the n unique ids ascending, then -1), `inverse [B]` (each lookup's
position in `uniq`; -1 for a padding lookup), `counts [B]` (occurrences; 0 past n), `n_uniq [1]` on the ids'
device. Fixed capacity keeps the GPU path free of host syncs: nothing downstream needs n on the host.
"""
from __future__ import annotations

import torch

from .dispatch import backend_for

PAD_ID = -1


def unique_ids_torch(ids: torch.Tensor, padding_idx: int | None = None):
    """Reference: torch.unique, then the padding id (if present) removed from the unique set."""
    n_lookups = ids.numel()
    ids = ids.reshape(-1).to(torch.int64)
    uniq, inverse, counts = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
    if padding_idx is not None:
        keep = uniq != padding_idx
        new_pos = torch.cumsum(keep, 0) - 1
        inverse = torch.where(keep[inverse], new_pos[inverse], torch.full_like(inverse, PAD_ID))
        uniq, counts = uniq[keep], counts[keep]
    n = uniq.numel()
    uniq_buf = torch.full((n_lookups,), PAD_ID, dtype=torch.int64, device=ids.device)
    count_buf = torch.zeros(n_lookups, dtype=torch.int64, device=ids.device)
    uniq_buf[:n] = uniq
    count_buf[:n] = counts
    n_uniq = torch.tensor([n], dtype=torch.int64, device=ids.device)
    return uniq_buf, inverse.reshape(-1), count_buf, n_uniq


def unique_ids(ids: torch.Tensor, padding_idx: int | None = None):
    if backend_for(ids.device) == "triton":
        return unique_ids_triton(ids, padding_idx)
    return unique_ids_torch(ids, padding_idx)
