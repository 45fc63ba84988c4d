"""Host tables at their real size: exact-size anonymous memory, huge-page backed, registered with CUDA.

torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two, so a 25.6 GB table would
pin 32 GB. Here the memory is an exact-size anonymous mapping, advised to use transparent huge pages (random
row access over a multi-GB table is otherwise TLB-bound) and, when CUDA exists, page-locked and mapped for the
GPU with `cudaHostRegister` (portable + mapped: DMA and zero-copy access from kernels). The registration is
dropped when the last tensor viewing the memory is gone. A CPU-only process never pins.

Unpinned, the same memory holds what else is read at random over tens of MB on the host: a CPU cache's rows and
the read-ahead's id map (on the 2-core dev box the 8M x 64, 400k-row cache step measured the same either way,
15.9 ms median over six paired runs: there the box's noise, not TLB reach, bounds it).
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import sys
import weakref

import torch

_MADV_HUGEPAGE = 14
_HUGE_PAGE_MIN_BYTES = 4 << 20  # two huge pages: below that no aligned 2 MiB range is likely inside
# cudaHostRegisterPortable | cudaHostRegisterMapped
_REGISTER_FLAGS = 0x01 | 0x02


def advise_huge_pages(address: int, size: int) -> None:
    """madvise(MADV_HUGEPAGE) over [address, address + size); a no-op where unsupported."""
    if size < _HUGE_PAGE_MIN_BYTES or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = (address + page - 1) // page * page
        end = (address + size) // page * page
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        return  # huge pages only speed things up; plain pages are correct


def _unregister(address: int, mapping: mmap.mmap) -> None:
    """Runs when the last tensor over `mapping` is gone; `mapping` is held until then, so the pages are still
    mapped while they are unregistered, and unmapped when this reference drops."""
    # At interpreter shutdown CUDA may already be torn down: then there is nothing left to release.
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(address)


def host_empty(shape, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialized host tensor of exactly `shape` (no rounding), page-locked for CUDA when `pinned`."""
    shape = tuple(int(d) for d in shape)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds `export` (a view of the mapping) as long as any tensor over it lives; its death is
    # the signal to unregister.
    export = memoryview(mapping)
    flat = torch.frombuffer(export, dtype=torch.uint8)
    address = flat.data_ptr()
    advise_huge_pages(address, nbytes)
    if pinned:
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _REGISTER_FLAGS)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)} "
                               "(page-locked memory limit? see `ulimit -l`)")
        weakref.finalize(export, _unregister, address, mapping)
    return flat.view(dtype).view(shape)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """An exact-size, CUDA-registered host copy of `t`."""
    out = host_empty(t.shape, t.dtype, pinned=True)
    out.copy_(t)
    return out
