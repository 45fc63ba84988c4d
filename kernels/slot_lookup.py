"""id -> cache slot lookup over a sorted index of the resident ids.

The index is two [C] tensors: `keys` (resident ids ascending, empty slots as INT64_MAX at the end) and `slots`
(the slot holding each key). Device memory is O(cache rows), not O(table rows); a lookup is a binary search.
"""
from __future__ import annotations

import torch

from .dispatch import backend_for

EMPTY_KEY = torch.iinfo(torch.int64).max


def slot_lookup_torch(keys: torch.Tensor, slots: torch.Tensor, query: torch.Tensor, n_query: torch.Tensor):
    """Slot of each of the first n_query ids of `query` [B]; -1 for a miss, a negative id, or a position >= n."""
    capacity = keys.numel()
    if capacity == 0:
        return torch.full_like(query, -1)
    pos = torch.searchsorted(keys, query).clamp_(max=capacity - 1)
    valid = torch.arange(query.numel(), device=query.device) < n_query
    hit = (keys[pos] == query) & valid & (query >= 0)
    return torch.where(hit, slots[pos], torch.full_like(query, -1))


def slot_lookup(keys: torch.Tensor, slots: torch.Tensor, query: torch.Tensor, n_query: torch.Tensor):
    if backend_for(query.device) == "triton":
        return slot_lookup_triton(keys, slots, query, n_query)
    return slot_lookup_torch(keys, slots, query, n_query)
