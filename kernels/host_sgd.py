"""Plain SGD on CPU cache rows in one C pass, for the CPU backward's fused update (sparse_update._update_rows).

The torch code gathers a block's rows, adds the scaled gradient and scatters them back: three passes over rows
that sit at random in a table of hundreds of MB, ~7 ms for the ~40k rows a batch of 4096 x 26 Zipf ids
updates, a quarter of a CPU training step. `host_sgd.c` updates each row in place with the same fused
multiply-add that torch's vectorized `add_(g, alpha=-lr)` performs (the same bits; the tests compare them over
many shapes), prefetching the rows ahead: ~2.5 ms. The torch code stays the reference: without the C library
(or with it off), without FMA, or where the tensors are not float32 CPU rows it runs.
"""
from __future__ import annotations

import ctypes

import torch

from .native import Helper

_BUMP = getattr(torch.autograd.graph, "increment_version", None)
_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("host_sgd", {"cemb_sgd_rows": ([_P, _I64, _P, _I64, _P, _I64, ctypes.c_double], _I64)})


def _fused_add() -> bool:
    """Whether torch's CPU add runs its vectorized kernels (fused multiply-add), not the default build."""
    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return get is not None and get() != "DEFAULT"


def sgd_rows(rows: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, alpha: float) -> bool:
    """rows[idx] += alpha * g for distinct idx, as `w = rows[idx]; w.add_(g, alpha=alpha); rows[idx] = w`.
    Returns False, having done nothing, where the fast path does not apply."""
    c = NATIVE.get()
    if (c is None or _BUMP is None or not _fused_add() or rows.device.type != "cpu" or g.device.type != "cpu"
            or idx.device.type != "cpu" or rows.dtype != torch.float32 or g.dtype != torch.float32
            or rows.dim() != 2 or g.dim() != 2 or g.shape[1] != rows.shape[1] or g.shape[0] != idx.numel()
            or not rows.is_contiguous() or rows.is_conj() or rows.is_neg() or g.is_conj() or g.is_neg()):
        return False
    g = g.contiguous()
    idx = idx.reshape(-1).to(torch.int64).contiguous()
    if not c.cemb_sgd_rows(rows.data_ptr(), rows.shape[0], idx.data_ptr(), idx.numel(), g.data_ptr(),
                           rows.shape[1], float(alpha)):
        return False
    _BUMP(rows)
    return True
