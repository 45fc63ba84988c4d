"""The file tier's exact table id -> slab row map on the host, with its per-id loops in C.

The host cache looks up every distinct id of a batch (~40k), inserts its misses and deletes its victims (~15k
each): through the torch reference of `kernels.id_index` (probe rounds with compaction) that was ~10 ms a step
at 8M rows, a fifth of an in-memory step. `row_index.c` walks the same layout one id at a time (one pass, no GIL)
where the package's C library is installed and on (kernels/native.py); the torch code runs otherwise. Lookups give the same
rows either way; where an insert lands may differ (the C loop places ids in order, the reference in rounds), as on
the Triton backend.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from cachedemb import kernels
from cachedemb.kernels import id_index
from cachedemb.kernels.native import Helper

_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("row_index", {
    "cemb_ri_lookup": ([_P, _I64, _P, _I64, _P], None),
    "cemb_ri_insert": ([_P, _I64, _P, _P, _I64, _I64, _P], _I64),
    "cemb_ri_delete": ([_P, _I64, _P, _I64], None),
    "cemb_ri_build": ([_P, _I64, _P, _P, _I64], None),
})


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


class RowIndex:
    """Exact table id -> slab row map on the host: the device cache's packed open addressing
    (`kernels.id_index`, 8 B a position, a power of two >= 2x the rows), its tombstones cleared by an in-place
    rebuild once 5/8 of the positions are used."""

    def __init__(self, rows: int):
        self.keys = id_index.new_index(2 * rows, "cpu")  # >= 4x the rows: a rebuild every few batches at most
        self.used = 0
        self.limit = self.keys.numel() * 5 // 8

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        c = NATIVE.get()
        if c is not None:
            ids = _i64(ids)
            out = np.empty_like(ids)
            c.cemb_ri_lookup(self.keys.data_ptr(), self.keys.numel() - 1, ids.ctypes.data, ids.size, out.ctypes.data)
            return out
        q = torch.from_numpy(ids)
        return kernels.index_lookup(self.keys, q, torch.tensor([q.numel()]), True).numpy()

    def _insert(self, ids: np.ndarray, rows: np.ndarray) -> bool:
        c = NATIVE.get()
        if c is not None:
            ids, rows = _i64(ids), _i64(rows)
            ok = np.empty(ids.size, dtype=np.uint8)
            c.cemb_ri_insert(self.keys.data_ptr(), self.keys.numel() - 1, ids.ctypes.data, rows.ctypes.data,
                             ids.size, id_index.MAX_PROBE, ok.ctypes.data)
            return bool(ok.all())
        q, r = torch.from_numpy(ids), torch.from_numpy(rows)
        return bool(kernels.index_insert(self.keys, q, r, torch.tensor([q.numel()]), True).all())

    def insert(self, ids: np.ndarray, rows: np.ndarray, live) -> None:
        """Insert absent `ids` at `rows`; `live()` gives the other resident (ids, rows), for a rebuild."""
        if self.used + ids.size > self.limit:
            l_ids, l_rows = live()
            # Staging rows (a batch larger than the slab) can outgrow the index it was sized for: keep the
            # load at most 1/4 after the rebuild, as at construction.
            size = self.keys.numel()
            while 4 * (l_ids.size + ids.size) > size:
                size *= 2
            if size != self.keys.numel():
                self.keys = torch.full((size,), id_index.EMPTY, dtype=torch.int64)
                self.limit = size * 5 // 8
            self.rebuild(l_ids, l_rows)
        placed = self._insert(ids, rows)
        self.used += ids.size
        if not placed:  # a probe ran past MAX_PROBE (rare): a table twice as large, laid out anew
            others, at = live()
            self.keys = torch.full((2 * self.keys.numel(),), id_index.EMPTY, dtype=torch.int64)
            self.limit = self.keys.numel() * 5 // 8
            self.rebuild(np.concatenate([others, ids]), np.concatenate([at, rows]))

    def delete(self, ids: np.ndarray) -> None:
        c = NATIVE.get()
        if c is not None:
            ids = _i64(ids)
            c.cemb_ri_delete(self.keys.data_ptr(), self.keys.numel() - 1, ids.ctypes.data, ids.size)
            return
        q = torch.from_numpy(ids)
        kernels.index_delete(self.keys, q, q.numel(), True)

    def rebuild(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Every (id, row) laid out afresh, tombstones cleared (`insert` keeps the load <= 1/4 here)."""
        if ids.size >= self.keys.numel():
            raise ValueError(f"a row index of {self.keys.numel()} positions cannot hold {ids.size} ids")
        c = NATIVE.get()
        if c is not None:
            ids, rows = _i64(ids), _i64(rows)
            c.cemb_ri_build(self.keys.data_ptr(), self.keys.numel() - 1, ids.ctypes.data, rows.ctypes.data, ids.size)
        else:  # index_build places every id (a lookup walks a chain to its end)
            id_index.index_build(self.keys, torch.from_numpy(ids), torch.from_numpy(rows))
        self.used = ids.size

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * 8
