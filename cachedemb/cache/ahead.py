"""A batch's unique ids computed ahead of its forward, and where they sit: the prefetch pipeline's hand-off.

The pipeline computes `unique_ids` of the ids a forward is announced to look up on its read-ahead thread, and,
inside an admission window, each unique id's slot from the window's admission. `EmbeddingCache.prepare` takes the
hand-off only if it is exactly what it would compute: the same ids (compared in full), no padding id, the torch
backend (the reference it would run), counts on the host (a CPU cache outside the sync-free mode; on CUDA the
comparison would be a sync), and, for the slots, every slot still holding its id. Otherwise it computes them
itself; results never depend on the hand-off, only the time the forward takes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cachedemb import kernels
from cachedemb.cache.sync_mode import counts_on_host


@dataclass
class AheadBatch:
    ids: torch.Tensor  # [B] the ids the forward is expected to pass to prepare
    unique: tuple  # kernels.unique_ids(ids, None, return_groups=True)
    loc_u: torch.Tensor | None = None  # [n] cache slot of each unique id, inside a window (else None)


def accepts_ahead(device: torch.device) -> bool:
    """Whether a cache on `device` can take a hand-off (see the module docstring)."""
    return counts_on_host(device) and kernels.backend_for(device) == "torch"


def take_ahead(ahead: AheadBatch | None, ids: torch.Tensor, padding_idx: int | None, slot_ids: torch.Tensor):
    """(unique_ids outputs, loc_u or None) from the hand-off if it matches `ids`, else None."""
    if ahead is None or padding_idx is not None or not accepts_ahead(ids.device):
        return None
    if ahead.ids.shape != ids.shape or not torch.equal(ahead.ids, ids):
        return None
    loc_u = ahead.loc_u
    if loc_u is not None and (loc_u.numel() and int(loc_u.min()) < 0 or not torch.equal(
            slot_ids.index_select(0, loc_u), ahead.unique[0][: int(ahead.unique[3])])):
        loc_u = None  # served from the host, or a slot changed hands since the window's admission
    return ahead.unique, loc_u
