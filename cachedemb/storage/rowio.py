"""Span reads and writes of table records: the loop over spans in C (the package's C library) or in Python.

A miss is one record at a random offset, so a batch is thousands of small positional reads. `os.preadv` per
span costs ~1.5 us of Python each and holds the GIL between calls; `rowio.c` runs the same loop in C under a
single ctypes call (ctypes releases the GIL), so the I/O threads overlap the training step instead of taking
turns with it. Where the package's C library is not installed, or is off (kernels/native.py), the Python loop
runs. Both give the same bytes (tests/test_storage_file.py runs both).

Writes that create the file's pages go in pieces of at most a page (see rowio.c: a record later written into a
large page-cache folio costs ~5x the kernel time of one written into a 4 KiB folio), both loops alike.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from cachedemb.kernels.native import Helper
from cachedemb.storage.format import PAGE

_COPY_BUF = 64 << 10  # as rowio.c's COPY_BUF
# A read spans records at most this many bytes apart (rowio.c's READ_GAP): recorded 1/16 steps' misses
# (8M rows, log mode, sorted) read at 0.57-0.62 us of CPU a record one run of adjacent records a call, 0.34-0.41
# with 2 KiB gaps spanned (0.29 calls a record instead of 0.75), no better at 4-8 KiB.
READ_GAP = 2048
_INT, _I64, _P, _I64P = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
NATIVE = Helper("rowio", {
    "cemb_pread_spans": ([_INT, _I64P, _I64P, _I64, _I64, _P], _I64),
    "cemb_pwrite_spans": ([_INT, _I64P, _I64P, _I64, _I64, _P], _I64),
    "cemb_pwrite_paged": ([_INT, _P, _I64, _I64], _I64),
    "cemb_copy_paged": ([_INT, _I64, _I64, _I64], _I64),
})


def backend() -> str:
    """Which span loop runs: "c" (rowio.c) or "python"."""
    return "c" if NATIVE.get() is not None else "python"


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(_I64P)


def spans(offsets: np.ndarray, rec: int, gap: int = 0) -> np.ndarray:
    """Starts (plus the end) of the spans of ascending record `offsets` that one call each covers: records at most
    `gap` bytes apart (0, writes: runs of adjacent records; READ_GAP for reads)."""
    if offsets.size == 0:
        return np.zeros(1, dtype=np.int64)
    step = np.diff(offsets)
    breaks = np.flatnonzero((step < rec) | (step > rec + gap)) + 1
    return np.concatenate([[0], breaks, [offsets.size]]).astype(np.int64)


def gap_bytes(offsets: np.ndarray, starts: np.ndarray, rec: int) -> int:
    """Bytes between the records of these spans: what a read copies beyond the records it was asked for."""
    if starts.size < 2:
        return 0
    first, last = offsets[starts[:-1]], offsets[starts[1:] - 1]
    return int((last + rec - first).sum()) - int(starts[-1] - starts[0]) * rec


def pread_spans(fd: int, offsets: np.ndarray, starts: np.ndarray, rec: int, buf: np.ndarray) -> int:
    """Read spans (see rowio.c: records `spans(offsets, rec, READ_GAP)` grouped) into `buf` (a writable uint8 array of
    len(offsets) * rec bytes). Returns 0, or 1 + the index of a span that met the end of the file; raises OSError
    on an I/O error."""
    lib = NATIVE.get()
    if lib is not None:
        offsets, starts = np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(starts, np.int64)
        rc = lib.cemb_pread_spans(fd, _ptr(offsets), _ptr(starts), starts.size - 1, rec, buf.ctypes.data)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))
        return int(rc)
    view = memoryview(buf).cast("B")
    for i, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        first = int(offsets[a])
        span = bytearray(int(offsets[b - 1]) + rec - first)  # the span's bytes, gaps and all
        at, want = 0, len(span)
        with memoryview(span) as whole:
            while want:
                got = os.preadv(fd, [whole[at:]], first + at)
                if got == 0:
                    return 1 + i
                at, want = at + got, want - got
            for j in range(a, b):
                pos = int(offsets[j]) - first
                view[j * rec: (j + 1) * rec] = whole[pos: pos + rec]
    return 0


def pwrite_spans(fd: int, offsets: np.ndarray, starts: np.ndarray, rec: int, buf: np.ndarray) -> None:
    """Write spans (see rowio.c) from `buf`; raises OSError on an I/O error."""
    lib = NATIVE.get()
    if lib is not None:
        offsets, starts = np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(starts, np.int64)
        rc = lib.cemb_pwrite_spans(fd, _ptr(offsets), _ptr(starts), starts.size - 1, rec, buf.ctypes.data)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))
        return
    view = memoryview(buf).cast("B")
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        _write_paged(fd, view[a * rec: b * rec], int(offsets[a]))


def pwrite_paged(fd: int, data, offset: int) -> None:
    """Write all of `data` (bytes-like) at `offset`, in page pieces when it is two pages or longer."""
    view = memoryview(data).cast("B")
    lib = NATIVE.get()
    if lib is not None:
        arr = np.frombuffer(view, dtype=np.uint8)
        rc = lib.cemb_pwrite_paged(fd, arr.ctypes.data, arr.size, offset)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))
        return
    _write_paged(fd, view, offset)


def copy_paged(fd: int, src: int, dst: int, length: int) -> bool:
    """Copy `length` bytes of the file from `src` to `dst` (non-overlapping) through a 64 KiB buffer, written in
    page pieces (copy_file_range would create large folios at `dst`); False when the source ends early."""
    lib = NATIVE.get()
    if lib is not None:
        rc = lib.cemb_copy_paged(fd, src, dst, length)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))
        return rc == 0
    while length > 0:
        data = os.pread(fd, min(length, _COPY_BUF), src)
        if not data:
            return False
        _write_paged(fd, memoryview(data), dst)
        src, dst, length = src + len(data), dst + len(data), length - len(data)
    return True


def _write_paged(fd: int, view: memoryview, off: int) -> None:
    """rowio.c's write_paged: one call under two pages, else pieces ending at page boundaries."""
    while view.nbytes:
        piece = view.nbytes if view.nbytes < 2 * PAGE else PAGE - off % PAGE
        put = os.pwritev(fd, [view[:piece]], off)
        view, off = view[put:], off + put
