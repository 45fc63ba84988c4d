"""Backend choice for the cache ops: Triton on CUDA tensors, the pure-torch reference elsewhere.

`CACHEDEMB_BACKEND=torch|triton` forces one (read at call time, so tests can switch it). Forcing `triton`
on CPU tensors needs `TRITON_INTERPRET=1` set before triton is first imported.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("torch", "triton")


def forced_backend() -> str | None:
    value = os.environ.get("CACHEDEMB_BACKEND", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(f"CACHEDEMB_BACKEND={value!r}: expected one of {BACKENDS} or unset")
    return value


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(device: torch.device) -> str:
    """The backend an op on tensors living on `device` runs with."""
    forced = forced_backend()
    if forced is not None:
        return forced
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"
