"""Backend choice for the cache ops: Triton on CUDA tensors, the pure-torch reference elsewhere.

`CACHEDEMB_BACKEND=torch|triton` forces one (read at call time, so tests can switch it). Forcing `triton`
on CPU tensors needs `TRITON_INTERPRET=1` set before triton is first imported.
"""
from __future__ import annotations

import contextlib
import functools
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


def on_device(t: torch.Tensor):
    """The launch context for a kernel over `t`: Triton launches on the *current* CUDA device, so a module on
    cuda:1 must make cuda:1 current for its launches (one GPU per torchrun rank)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def gpu_shapes(device: torch.device) -> bool:
    """Whether launchers pick their GPU block shapes: on CUDA, or on CPU with `CACHEDEMB_GPU_SHAPES=1` (the AOT
    compile check records the variants a GPU runs without one; under the interpreter CPU launches otherwise use
    few, large programs)."""
    return device.type == "cuda" or os.environ.get("CACHEDEMB_GPU_SHAPES", "") == "1"


def soft_rtne(device: torch.device) -> bool:
    """Round fp32 -> bf16 to nearest-even in integer ops: needed where Triton's CPU interpreter truncates that
    cast; a GPU rounds by itself (and the AOT check records the GPU's variant)."""
    return device.type == "cpu" and not gpu_shapes(device)


def persistent_programs(device: torch.device, bound: int) -> int:
    """Grid of the persistent kernels: programs loop over work items up to a count read on the device, so the
    grid is sized by the machine (4 programs per SM on CUDA), not by the capacity of the buffers, and a step
    with fixed shapes launches the same grids every time (CUDA-graph capturable); never more programs than
    `bound` items. CPU (the interpreter runs programs one after another): 8."""
    if device.type == "cuda":
        programs = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    elif gpu_shapes(device):
        programs = 4 * 132  # H100's SMs: what the AOT recording launches
    else:
        programs = 8
    return max(1, min(bound, programs))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gate_bytes(gate, device: torch.device) -> torch.Tensor:
    """A gated kernel's [1] run flag as one byte, whatever the caller's flag dtype (one compiled variant);
    None: run."""
    if gate is None:
        return torch.ones(1, dtype=torch.uint8, device=device)
    flag = gate.reshape(1) if gate.dtype == torch.bool else gate.reshape(1) != 0
    return flag.view(torch.uint8)
