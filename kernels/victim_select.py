"""Victim selection: the k cache slots with the smallest eviction scores, ascending.

Scores are int64 and distinct (policies fold the slot index into the low bits), so the choice is deterministic.
A protected slot carries INT64_MAX; callers take only as many victims as there are unprotected slots.
"""
from __future__ import annotations

import torch

from .dispatch import backend_for

PROTECTED = torch.iinfo(torch.int64).max


def victim_select_torch(score: torch.Tensor, k: int):
    """Reference: a full top-k. Returns int64 slots [k], smallest score first."""
    k = min(int(k), score.numel())
    return torch.topk(score, k, largest=False, sorted=True).indices


def victim_select(score: torch.Tensor, k: int):
    if backend_for(score.device) == "triton":
        return victim_select_triton(score, k)
    return victim_select_torch(score, k)
