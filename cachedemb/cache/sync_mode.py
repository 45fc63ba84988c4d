"""The sync-free mode: CPU tensors follow the CUDA path's rules, so CI (no GPU) runs the code CUDA runs.

On CUDA a host read of a device count (`int(t)`, `.item()`, `.tolist()`, `.cpu()`) stalls the stream, so the
cache sizes per-batch work by static bounds and keeps counts on the device. On CPU such reads are free and the
cache uses them to size work exactly. `CACHEDEMB_SYNC_FREE=1` (read at call time) turns that off: CPU tensors
then take exactly the static-bound, device-count paths, and input values are not read unless validation asks.
"""
from __future__ import annotations

import os

import torch


def sync_free() -> bool:
    return os.environ.get("CACHEDEMB_SYNC_FREE", "").strip().lower() in ("1", "true", "yes", "on")


def counts_on_host(device: torch.device) -> bool:
    """Whether the cache may read a count on `device` on the host (free on CPU, outside the sync-free mode)."""
    return torch.device(device).type == "cpu" and not sync_free()
