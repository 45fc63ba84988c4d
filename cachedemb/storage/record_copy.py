"""Table records to and from the host cache's row tensors (weight, each optimizer state, count) in one C pass.

Landing a read batch took five torch ops per reader-thread part (index_copy_ of each field through the record
views), packing a write-back batch three gathers and three copies on the training thread; on the file tier's
reader threads each op is a turn at the GIL against the training thread. `record_copy.c` does either in one
ctypes call (no GIL held). The torch code in host_cache.py (format.RecordLayout's views and `pack`) is the
reference: the C library missing or off, or rows that are not plain contiguous CPU tensors run it, and the
tests compare the two byte for byte.
"""
from __future__ import annotations

import ctypes

import torch

from cachedemb.kernels.native import Helper
from cachedemb.storage.format import RecordLayout

_I64, _P = ctypes.c_int64, ctypes.c_void_p
NATIVE = Helper("record_copy", {
    "cemb_record_copy": ([_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _I64], None),
})


class RecordFields:
    """Where each field of a record goes in the host rows: byte offset and length in the record, row tensor
    base address and row stride. None from `of` where the C pass does not apply."""

    def __init__(self, layout: RecordLayout, tensors: list[torch.Tensor], offsets: list[int], lengths: list[int]):
        self.record = layout.record_bytes
        self.tensors = tensors  # kept: the addresses below stay valid while this lives
        self.off = torch.tensor(offsets, dtype=torch.int64)
        self.len = torch.tensor(lengths, dtype=torch.int64)
        self.base = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
        self.stride = torch.tensor([t.stride(0) * t.element_size() for t in tensors], dtype=torch.int64)
        self.rows = tensors[0].shape[0]

    @staticmethod
    def of(layout: RecordLayout, weight: torch.Tensor, states: dict[str, torch.Tensor], counts: torch.Tensor):
        c = NATIVE.get()
        state_at = layout.state_offsets()
        names = [name for name, _, _ in layout.state_cols]
        if c is None or set(states) != set(names):
            return None
        tensors = [weight] + [states[name] for name in names] + [counts]
        if any(
                t.device.type != "cpu" or t.shape[0] != weight.shape[0] or not t.is_contiguous() for t in tensors):
            return None
        size = torch.empty(0, dtype=layout.state_dtype).element_size()
        cols = {name: n for name, n, _ in layout.state_cols}
        if weight.dtype != layout.dtype or weight.dim() != 2 or weight.shape[1] != layout.dim or counts.dtype != \
                torch.int64 or counts.dim() != 1 or any(states[n].dtype != layout.state_dtype or states[n].dim() != 2
                                                        or states[n].shape[1] != cols[n] for n in names):
            return None
        offsets = [0] + [state_at[name] for name in names] + [layout.count_offset]
        lengths = [layout.weight_bytes] + [cols[name] * size for name in names] + [8]
        return RecordFields(layout, tensors, offsets, lengths)

    def _run(self, records: torch.Tensor, rows: torch.Tensor, order: torch.Tensor | None, to_records: int) -> None:
        rows = rows.to(torch.int64).contiguous()
        n = records.shape[0]
        if n and not (0 <= int(rows.min()) and int(rows.max()) < self.rows):
            raise IndexError(f"rows must lie in [0, {self.rows}), got [{int(rows.min())}, {int(rows.max())}]")
        if order is not None:
            order = order.to(torch.int64).contiguous()
            if n and not (0 <= int(order.min()) and int(order.max()) < rows.numel()):
                raise IndexError(f"order must index the {rows.numel()} rows")
        elif rows.numel() != n:
            raise ValueError(f"{rows.numel()} rows for {n} records")
        NATIVE.get().cemb_record_copy(records.data_ptr(), self.record, n, rows.data_ptr(),
                                  None if order is None else order.data_ptr(), self.off.numel(), self.off.data_ptr(),
                                  self.len.data_ptr(), self.base.data_ptr(), self.stride.data_ptr(), to_records)

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """[k, record] uint8 records of host rows `rows` (padding bytes zero): `RecordLayout.pack`'s bytes."""
        out = torch.empty(rows.numel(), self.record, dtype=torch.uint8)
        self._run(out, rows, None, 1)
        return out

    def land(self, records: torch.Tensor, rows: torch.Tensor, order: torch.Tensor | None = None) -> None:
        """Each record i into host row rows[i] (rows[order[i]] with `order`); the rows are distinct."""
        records = records.contiguous()
        if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != self.record:
            raise ValueError(f"records must be uint8 [k, {self.record}], got {records.dtype} "
                             f"{list(records.shape)}")
        self._run(records, rows, order, 0)
