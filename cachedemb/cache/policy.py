"""Eviction policies: small pure functions from per-slot metadata to int64 eviction scores.

Lower score = evicted first. Scores are distinct (the slot index is folded into the low bits), so victim
choice is deterministic; empty slots score below every occupied one; protected slots score PROTECTED.
A policy is replaceable: any function with this signature can be passed as `policy=`.

A view may cover only some slots (`slots` names them, `capacity` is the cache's): a policy scores each entry
from that entry's metadata alone, so a slot's score is the same in any view (the victim pool relies on this).
A policy marked `@monotone` promises more: while a slot keeps its id and its protection, its score never drops
when the cache records a use (count up, last use later); the cache may then re-score only a candidate pool
(cachedemb/cache/victim_pool.py). Unmarked policies get a full ranking of every slot per batch with misses.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from cachedemb import kernels
from cachedemb.kernels import PROTECTED

Policy = Callable[["SlotView"], torch.Tensor]

# Keys stay below 2^33 and slots below 2^30, so key * capacity + slot fits in int64. The look-ahead policy
# ranks rows with a known next use inside the horizon above every row without one (counts are capped).
_TIER = 1 << 32


class SlotView(NamedTuple):
    """What a policy may read about the C cache slots (all [C] tensors on the cache device)."""

    slot_ids: torch.Tensor  # int64, -1 = empty
    freq: torch.Tensor  # int64 access counts (persist on the host across evictions)
    last_use: torch.Tensor  # int64 batch number of the last access
    next_use: torch.Tensor  # int64 batches until the next known use; -1 = none inside the horizon
    protected: torch.Tensor  # bool: needed by a batch in flight, never evicted
    table_rank: torch.Tensor | None = None  # int64 rank of the row's table by size (0 = largest), if known
    slots: torch.Tensor | None = None  # int64 slot of each entry; None: entry i is slot i (all C slots)
    capacity: int | None = None  # C, the cache's slot count; None: the view's length


def monotone(policy: Policy) -> Policy:
    """Mark a policy whose scores never drop on a recorded use (see the module docstring)."""
    policy.monotone = True
    return policy


def is_monotone(policy) -> bool:
    return bool(getattr(policy, "monotone", False))


def _finish(view: SlotView, key: torch.Tensor) -> torch.Tensor:
    capacity = view.slot_ids.numel() if view.capacity is None else view.capacity
    slot = torch.arange(capacity, device=key.device) if view.slots is None else view.slots
    score = key * capacity + slot
    score = torch.where(view.slot_ids < 0, slot - capacity, score)
    return score.masked_fill_(view.protected, PROTECTED)


@monotone
def lfu(view: SlotView) -> torch.Tensor:
    """Least frequently used first; ties by slot."""
    return _finish(view, view.freq.clamp(max=2 * _TIER - 1))


@monotone
def lru(view: SlotView) -> torch.Tensor:
    """Least recently used first; ties by slot."""
    return _finish(view, view.last_use.clamp(max=2 * _TIER - 1))


@monotone
def lookahead(view: SlotView) -> torch.Tensor:
    """Rows with no use inside the horizon first (least frequent first; among equal counts, rows of larger
    tables first, since the same count means less in a flatter table), then the row used furthest ahead
    (Belady inside the horizon)."""
    no_use = view.next_use < 0
    far_first = (2 * _TIER - 1) - view.next_use.clamp(min=0, max=_TIER - 1)  # _TIER + (_TIER - 1 - next use)
    by_count = view.freq.clamp(max=(1 << 24) - 1).mul_(256)
    if view.table_rank is not None:  # (a single table ranks 0: nothing to add)
        by_count.add_(view.table_rank.clamp(max=255))
    return _finish(view, torch.where(no_use, by_count, far_first))


POLICIES: dict[str, Policy] = {"lfu": lfu, "lru": lru, "lookahead": lookahead}

# The built-in policies the Triton backend scores in one launch (kernels/slot_score.py, equal bit for bit); keyed
# by the function itself, so a user's wrapper of one (even with functools.wraps) is scored by its own code.
_SCORE_KERNEL = {lfu: kernels.SCORE_LFU, lru: kernels.SCORE_LRU, lookahead: kernels.SCORE_LOOKAHEAD}


def score_kernel(policy) -> int | None:
    """The slot-score kernel kind that computes `policy`'s full-view scores, or None (score with the policy)."""
    try:
        return _SCORE_KERNEL.get(policy)
    except TypeError:  # an unhashable callable
        return None


def resolve(policy: str | Policy) -> Policy:
    if callable(policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: expected one of {sorted(POLICIES)} or a callable(SlotView)")
    return POLICIES[policy]
