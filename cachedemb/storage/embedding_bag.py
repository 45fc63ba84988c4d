"""FileBackedEmbeddingBag: nn.EmbeddingBag over a table on local disk, three tiers deep.

```
table ids [B] -> HostRowCache (host, O(batch) per step)      ids -> slab rows; misses read from the file
              -> CachedEmbeddingBag over the slab             the device cache, kernels and fused optimizer as
                                                              for any in-memory table
file (TableFile): rows + optimizer state + access counts, copy-on-write snapshots
```

Built by `CachedEmbeddingBag(num_embeddings, dim, ..., optimizer=..., storage=FileStorage(path,
host_cache_bytes=...))`. A new path is created and filled by streaming (nn.EmbeddingBag's N(0, 1) drawn in
chunks, or `_weight` / `from_pretrained` rows copied in chunks); an existing file is opened and checked against
the module's shape, dtype and optimizer, and training continues from its newest snapshot.

Training equals in-memory training bit for bit: every row a batch reads is in the slab, with its optimizer state
and count, before the inner module's forward, and the fused update runs on it there or in the device cache, as it
would in memory. Under `cachedemb.prefetch` the mapping runs when a batch is read ahead (its misses are read
from the file asynchronously and its rows are held until it is done); the window admission waits for the reads
through the cache's `host_fence`. A read-ahead batch that finds no room pauses the read-ahead; its forward then
maps it (and catches the queue up), as `cachedemb.dynamic` does.

`state_dict()` commits a snapshot and returns a small descriptor (`storage.uuid`, `storage.snapshot`,
`optimizer.step`), never the rows: `cachedemb.save_checkpoint(model.state_dict(), path)` is then crash-safe
for the whole model (the file retains the snapshot the checkpoint names until two more commits), and
`load_state_dict` rolls the file back to that snapshot. The rows themselves are exported by streaming:
`iter_rows()`, `to_embedding_bag()`, `export_state_dict()`.
"""
from __future__ import annotations

import os
import time
import uuid as uuid_lib
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from cachedemb.cache.ahead import AheadBatch, accepts_ahead
from cachedemb.modules.batch_input import batch_input
from cachedemb.modules.cache_stats import rate_of
from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.modules.errors import InvalidIdError, InvalidInputTypeError, NotATensorError
from cachedemb.modules.factory import register_storage
from cachedemb.modules.input_check import integer_arg, size_arg
from cachedemb.modules.meta_init import TableInit, iter_init_range
from cachedemb.kernels import id_index
from cachedemb.optim import SparseOptimizer
from cachedemb.sizing.plan import parse_bytes
from cachedemb.storage.format import (TableHeader, TableIOError, TableMismatchError, UncommittedRowsLostWarning,
                                      dtype_name)
from cachedemb.storage.host_cache import BatchDistinct, HostRowCache, distinct, slab_rows
from cachedemb.storage.log_structure import position_dtype
from cachedemb.storage.table_file import TableFile, iter_table_rows, open_table

BLOCK_TARGET_BYTES = 256 << 10  # a chunk of rows (the copy-on-write unit) is about this size
_TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class FileStorage:
    """Keep the table (rows, optimizer state, access counts) in the file `path` on local disk, with at most
    `host_cache_bytes` of it cached in host memory (pinned where CUDA exists): an int, or a string such as
    "64GiB" or "512MB" (binary and decimal units, as `cachedemb.sizing.parse_bytes` reads them).

    recover: open a file whose last writer died at its last committed snapshot (else that raises
    TableWriterDiedError). rows_per_block: rows per copy-on-write chunk (default ~256 KiB of records).
    io_threads: reader threads (reads in flight while the file's pages come from the disk; a warm page cache is
    read by one of them and the waiting forward). device_windows: under `cachedemb.prefetch`, also hand the
    read-ahead rows to the device cache's windows (default: for a CUDA cache, where a window overlaps the
    host->device copies with compute; on CPU the "device" cache is host memory and a window is extra copying, so
    only the file reads run ahead). read_ahead: without device windows, the batches of the prefetch horizon whose
    misses are read ahead (their rows held until they run); the later ones only steer the host cache's eviction.
    log: write evicted rows by appending them (a log-structured file, `cachedemb/storage/log_structure.py`) instead of
    rewriting them in place: ~8x less kernel time a row written, for a row map of 4 bytes a row counted in
    `host_cache_bytes`. None (default): a log when the map takes at most a quarter of `host_cache_bytes` (or as
    CACHEDEMB_STORAGE_LOG=1/0 says). A file that is a log stays one. log_slack: dead records the log may hold,
    as a fraction of the table's rows, before cleaning moves the live records out of the emptiest blocks (the
    file's growth beyond the table and its snapshots)."""

    path: str | os.PathLike
    host_cache_bytes: int | str
    recover: bool = False
    rows_per_block: int | None = None
    io_threads: int = 4
    device_windows: bool | None = None
    read_ahead: int = 2
    log: bool | None = None
    log_slack: float = 0.5

    def __post_init__(self):
        size = given = self.host_cache_bytes
        if isinstance(size, str):
            try:
                size = parse_bytes(size)
            except ValueError as e:
                raise ValueError(f"FileStorage.host_cache_bytes: {e}") from None
            object.__setattr__(self, "host_cache_bytes", size)  # frozen: the bytes from here on
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"FileStorage.host_cache_bytes must be a positive number of bytes (an int, or a "
                             f"string such as '64GiB'), got {given!r}")
        rpb = self.rows_per_block
        if rpb is not None and (isinstance(rpb, bool) or not isinstance(rpb, int) or rpb < 1):
            raise ValueError(f"FileStorage.rows_per_block must be None or a positive int, got {rpb!r}")
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ValueError(f"FileStorage.io_threads must be a positive int, got {self.io_threads!r}")
        if isinstance(self.read_ahead, bool) or not isinstance(self.read_ahead, int) or self.read_ahead < 1:
            raise ValueError(f"FileStorage.read_ahead must be a positive int (batches), got {self.read_ahead!r}")
        if self.log is not None and not isinstance(self.log, bool):
            raise ValueError(f"FileStorage.log must be None, True or False, got {self.log!r}")
        if isinstance(self.log_slack, bool) or not isinstance(self.log_slack, (int, float)) or \
                not 0 < self.log_slack <= 16:
            raise ValueError(f"FileStorage.log_slack must be a number in (0, 16] (a fraction of the table's rows), "
                             f"got {self.log_slack!r}")

    def wants_log(self, num_rows: int, rows_per_block: int) -> bool:
        """Whether a new table of `num_rows` is written as a log (see `log`)."""
        if self.log is not None:
            return self.log
        forced = os.environ.get("CACHEDEMB_STORAGE_LOG", "")
        if forced in ("0", "1"):
            return forced == "1"
        return num_rows * position_dtype(num_rows, rows_per_block).itemsize <= self.host_cache_bytes // 4


@dataclass
class ReadAheadBatch:
    """A training batch read ahead by cachedemb.prefetch, until its forward (the file tier's view of it)."""

    flat: torch.Tensor  # its ids, flattened (the forward checks it gets these)
    seq: int  # its sequence number among training batches
    distinct: BatchDistinct | None = None  # its kept ids' distinct ids (None: not looked at yet)
    found: np.ndarray | None = None  # their slab rows when it was looked at (-1: not cached then)
    rows: np.ndarray | None = None  # their slab rows, held for it (None: not mapped, or un-mapped)
    inner_unique: tuple | None = None  # the inner forward's unique_ids of those rows (with `rows`)


def state_columns(optimizer: SparseOptimizer | None, dim: int) -> tuple:
    layout = optimizer.state_layout(dim) if optimizer is not None else {}
    return tuple((name, int(cols), float(init)) for name, (cols, init) in layout.items())


@register_storage  # CachedEmbeddingBag(..., storage=FileStorage(...)) builds this class
class FileBackedEmbeddingBag(nn.Module):
    """nn.EmbeddingBag over a table kept in a file (see the module docstring)."""

    # prefetch_targets(batch) takes the batch's input by position (modules/batch_input.py): cachedemb.prefetch
    # refuses a default extraction shared by several such modules.
    reads_batch_by_position = True

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                 sparse: bool = False, _weight: torch.Tensor | None = None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device=None, dtype=None, *, storage: FileStorage,
                 optimizer: SparseOptimizer | None = None, _freeze: bool = False, cache_ratio: float = 0.01,
                 cache_rows: int | None = None, id_freq: torch.Tensor | None = None, warmup_ratio: float = 0.7,
                 validate_inputs: bool = True, freq_halflife: int | None = None, count_in_eval: bool = False,
                 _init: TableInit | None = None, _shard: dict | None = None, **cache_kwargs):
        super().__init__()
        if not isinstance(storage, FileStorage):
            raise TypeError(f"storage must be a cachedemb.FileStorage, got {type(storage).__name__}")
        num_embeddings = size_arg("num_embeddings", num_embeddings)
        embedding_dim = size_arg("embedding_dim", embedding_dim)
        if num_embeddings == 0 or embedding_dim == 0:
            raise ValueError(f"a file-backed table needs rows and columns, got {num_embeddings} x {embedding_dim}")
        if optimizer is None and not _freeze:
            raise ValueError("a file-backed table trains with a fused sparse optimizer (optimizer="
                             "cachedemb.optim.SGD / Adagrad / RowWiseAdagrad / Adam(...)), got optimizer=None: a "
                             "torch optimizer needs the whole table as a Parameter in memory. For inference "
                             "use CachedEmbeddingBag.from_pretrained(..., freeze=True, storage=...)")
        if optimizer is not None and not isinstance(optimizer, SparseOptimizer):
            raise TypeError(f"optimizer must be a cachedemb.optim spec, got {type(optimizer).__name__}")
        if freq_halflife is not None:
            raise ValueError("freq_halflife is not supported with storage=: halving every count is a pass over "
                             "the whole file; counts age only through eviction here")
        dtype = dtype or (_weight.dtype if _weight is not None else torch.get_default_dtype())
        if dtype not in _TABLE_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, _TABLE_DTYPES))}, got {dtype}")
        if device is not None and torch.device(device).type == "meta":
            raise ValueError("a file-backed table cannot be built on the meta device: give a real device (the "
                             "file holds the rows; nothing of the table is allocated in memory anyway)")
        if _weight is not None and tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"_weight must have shape ({num_embeddings}, {embedding_dim}), got "
                             f"{tuple(_weight.shape)}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.mode, self.sparse, self.include_last_offset = mode, sparse, include_last_offset
        self.max_norm, self.validate_inputs, self.count_in_eval = max_norm, validate_inputs, bool(count_in_eval)
        if padding_idx is not None:
            padding_idx = integer_arg("padding_idx", padding_idx)
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within num_embeddings: [-{num_embeddings}, "
                                 f"{num_embeddings}), got {padding_idx}")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.optimizer = optimizer
        self.storage = storage
        if _shard is not None and _shard["end"] - _shard["start"] != num_embeddings:
            raise ValueError(f"a shard of rows [{_shard['start']}, {_shard['end']}) has "
                             f"{_shard['end'] - _shard['start']} rows, not {num_embeddings}")
        # _shard (cachedemb.distributed): this file holds one rank's rows [start, end) of a larger table; ids are
        # local to the range, and a new file draws the whole table's init stream, keeping those rows.
        header = TableHeader(num_embeddings, embedding_dim, dtype, state_columns(optimizer, embedding_dim),
                             repr(optimizer) if optimizer is not None else "", 1, "", "", 0.0, _shard)
        record = header.layout.record_bytes
        rpb = storage.rows_per_block or max(1, BLOCK_TARGET_BYTES // record)  # a new file's; an old one has its own
        use_log = storage.wants_log(num_embeddings, rpb)
        row_map = num_embeddings * position_dtype(num_embeddings, rpb).itemsize if use_log else 0
        rows = _slab_rows_within(storage, record, row_map, num_embeddings)
        if num_embeddings > id_index.MAX_ID:
            raise ValueError(f"a table file holds ids < 2^33 (the host cache's index packs them), got "
                             f"{num_embeddings} rows: shard the table")
        self.table = self._open_or_create(storage, header, _weight, id_freq, padding_idx, _init, use_log, rpb)
        if self.table.index_bytes() != row_map:  # a file that is a log: its row map comes out of the budget
            try:
                rows = _slab_rows_within(storage, record, self.table.index_bytes(), num_embeddings)
            except ValueError:
                self.table.close()
                raise
        # The inner module: row 0 is the padding row, rows 1.. the slab (host cache).
        slab = torch.zeros(rows + 1, embedding_dim, dtype=dtype)
        capacity = min(rows, CachedEmbeddingBag.cache_capacity(num_embeddings, cache_ratio, cache_rows))
        inner = CachedEmbeddingBag(rows + 1, embedding_dim, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
                                   slab, include_last_offset, 0 if padding_idx is not None else None, device, dtype,
                                   _freeze=_freeze, optimizer=optimizer, cache_rows=capacity,
                                   validate_inputs=validate_inputs, count_in_eval=count_in_eval, warmup_ratio=0.0,
                                   **cache_kwargs)
        del slab
        inner._private_table = True  # the slab is never handed out; reader threads write its rows meanwhile
        inner._ratio_rows, inner._warn_as = num_embeddings, type(self).__name__  # cache_ratio is of the table's rows
        object.__setattr__(self, "inner", inner)  # not a child: the state is the file's
        inner.optimizer_step = int(self.table.snapshots[self.table.newest_seq][0].meta.get("optimizer_step", 0))
        self.host = HostRowCache(self.table, inner, rows, first=1)
        inner.cache.host_fence = self.host.fence
        inner.cache.window_misses_mean_other_ids = False  # slab rows move for the host tier's own reasons
        self.seq = 0  # sequence number of the next training batch
        self.ahead: deque[ReadAheadBatch] = deque()  # the batches read ahead, in training order
        # Closed (flushed, committed, released) by close(), when the module is collected, or at exit.
        self._finalizer = weakref.finalize(self, _close_table, inner, self.host, self.table)

    # ----------------------------------------------------------------- the file
    def _open_or_create(self, storage: FileStorage, header: TableHeader, weight, id_freq, padding_idx,
                        init: TableInit | None, log: bool, rpb: int) -> TableFile:
        path = Path(storage.path)
        if path.exists():
            if weight is not None:
                raise FileExistsError(f"table file {str(path)!r} exists: cachedemb never overwrites one with "
                                      "_weight / from_pretrained rows; open it without rows, or give a new path")
            if id_freq is not None:
                raise ValueError(f"id_freq cannot seed the existing table file {str(path)!r}: its counts are in it")
            return TableFile.open(path, writable=True, recover=storage.recover, expect=header,
                                  io_threads=storage.io_threads, log=log, log_slack=storage.log_slack)
        how = "weight" if weight is not None else "normal"
        header = TableHeader(header.num_rows, header.dim, header.dtype, header.state_cols, header.optimizer,
                             rpb, uuid_lib.uuid4().hex, how, time.time(), header.shard)
        init = init or TableInit.normal(padding_idx)
        first = header.shard["start"] if header.shard is not None else 0  # global id of row 0
        if weight is None and not init.elementwise:
            raise ValueError("a file-backed table streams its initial rows: its init must draw element by "
                             "element (normal_, uniform_); give other rows as _weight")
        freq = None
        if id_freq is not None:
            freq = torch.as_tensor(id_freq)
            if freq.shape != (header.num_rows,) or freq.is_floating_point() or bool((freq < 0).any()):
                raise ValueError(f"id_freq must be non-negative integer counts of shape ({header.num_rows},)")
        stream = None
        if weight is None:
            total = header.shard["table_rows"] if header.shard is not None else header.num_rows
            stream = iter_init_range(init, total, header.dim, header.dtype, first, first + header.num_rows)
        carry = [torch.empty(0, dtype=header.dtype)]

        def fill(start, stop):
            if weight is not None:
                rows = weight[start:stop].detach().to(device="cpu", dtype=header.dtype)
            else:  # the draws of one whole-table fill, consumed in order
                need, parts = (stop - start) * header.dim, []
                while need > 0:
                    if carry[0].numel() == 0:
                        carry[0] = next(stream)
                    part, carry[0] = carry[0][:need], carry[0][need:]
                    parts.append(part)
                    need -= part.numel()
                rows = torch.cat(parts).view(stop - start, header.dim)
                pad = init.padding_idx
                if pad is not None and start <= pad - first < stop:
                    rows[pad - first - start].zero_()
            states = {name: torch.full((stop - start, cols), value, dtype=header.layout.state_dtype)
                      for name, cols, value in header.state_cols}
            counts = freq[start:stop].to(torch.int64) if freq is not None else torch.zeros(stop - start,
                                                                                           dtype=torch.int64)
            return rows, states, counts

        table = TableFile.create(path, header, fill, io_threads=storage.io_threads, log=log,
                                 log_slack=storage.log_slack)
        if stream is not None:
            for _ in stream:  # a tail chunk not consumed (never, but the generator must end where a fill does)
                pass
        return table

    # ----------------------------------------------------------------- forward
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.is_tensor(input):
            raise NotATensorError(f"input must be a torch.Tensor of int32/int64, got {type(input).__name__}")
        if input.dtype not in (torch.int32, torch.int64):
            raise InvalidInputTypeError(f"input must hold int32 or int64 values, got dtype {input.dtype}")
        if self.table.closed:
            raise RuntimeError(f"the table file {str(self.table.path)!r} of this module was closed")
        flat = input.reshape(-1).to(device="cpu", dtype=torch.int64)
        valid = (flat >= 0) & (flat < self.num_embeddings)
        if self.validate_inputs and not bool(valid.all()):
            i = int(torch.nonzero(~valid)[0])
            raise InvalidIdError(f"input id {int(flat[i])} at position {i} is out of range: ids must be in [0, "
                                 f"{self.num_embeddings}) (num_embeddings={self.num_embeddings})")
        keep = valid if self.padding_idx is None else valid & (flat != self.padding_idx)
        every = bool(keep.all())  # no padding or invalid lookup: no masks to apply
        train = self.training and torch.is_grad_enabled()
        self.host.settle()
        rows_u, inverse, inner_unique = self._batch_rows(flat, None if every else keep, train)
        background = train and bool(self.ahead) and self._maps_in_background()
        if background:
            self.host.note_residency()
        self.host.maybe_resident[rows_u] = True
        self.host.fence(rows_u)
        writes = (train and self.optimizer is not None) or self.max_norm is not None or self.count_in_eval
        if writes:
            self.host.dirty[rows_u] = True
        # Padding lookups read inner row 0 (the inner padding row); invalid ids (validate_inputs=False) an
        # inner id out of range, which the inner module repairs and counts as it does for any table.
        if every:
            rows = torch.from_numpy(rows_u[inverse])
            if inner_unique is not None and self.padding_idx is None and accepts_ahead(self.inner.cache.device):
                self.inner.cache.ahead = AheadBatch(rows, inner_unique)  # the inner forward need not sort again
        else:
            rows = torch.where(valid, torch.zeros_like(flat), torch.full_like(flat, self.inner.num_embeddings))
            rows[keep] = torch.from_numpy(rows_u[inverse])
        self.inner.training = self.training
        self.table.prune()
        if background:  # the next read-ahead batches are mapped while this one runs forward and backward
            self.host.run_in_background(partial(_map_ahead_of, weakref.ref(self)))  # the job keeps no module alive
        return self.inner(rows.view(input.shape).to(input.device), offsets, per_sample_weights)

    def _batch_rows(self, flat: torch.Tensor, keep: torch.Tensor | None,
                    train: bool) -> tuple[np.ndarray, np.ndarray, tuple | None]:
        """(slab row of each distinct id, position of each kept lookup among them, the inner forward's unique ids
        of the rows if known) of a forward: the rows read ahead for it, else mapped now. `keep` None: every
        lookup is kept."""
        host = self.host
        if train and self.ahead:
            entry = self.ahead[0]
            if entry.flat.shape == flat.shape and torch.equal(entry.flat, flat):
                self.ahead.popleft()
                host.done_below = entry.seq
                if entry.distinct is None:  # not looked at by the mapper yet
                    entry.distinct = self._distinct(entry.flat)
                rows = entry.rows if entry.rows is not None else self._map_now(entry.distinct.ids, entry.seq)
                if not self._maps_in_background():
                    self._catch_up()
                inner = entry.inner_unique if entry.rows is not None else None
                return rows, entry.distinct.inverse, inner
            self._drop_ahead(keep=0)  # not the batch read ahead: the read-ahead batches are abandoned
            self.inner.cache.unread_ahead += 1  # cachedemb.prefetch warns: other ids than the ones read ahead
        batch = distinct(flat if keep is None else flat[keep], bound=self.num_embeddings)
        if not train:
            return host.map(batch.ids, None, grow=True, now=True), batch.inverse, None
        seq, self.seq = self.seq, self.seq + 1
        host.done_below = seq
        host.trim()
        return self._map_now(batch.ids, seq), batch.inverse, None

    def _map_now(self, uniq: np.ndarray, seq: int) -> np.ndarray:
        rows = self.host.map(uniq, seq, grow=False, now=True)
        if rows is None:  # the read-ahead batches hold the rows this one needs: they give them up first
            self._drop_ahead(keep=len(self.ahead))
            rows = self.host.map(uniq, seq, grow=True, now=True)
        return rows

    def _drop_ahead(self, keep: int) -> None:
        """Un-map the read-ahead batches (their rows no longer held); with keep > 0 they stay queued, to be
        mapped again at their forward."""
        host = self.host
        host.fence()
        released = False
        for entry in self.ahead:
            if entry.rows is not None:
                entry.rows = entry.inner_unique = None
                released = True
        if released:
            host.row_step[host.row_step >= host.done_below] = host.done_below - 1
        if not keep:
            self.ahead.clear()

    def _windows(self) -> bool:
        windows = self.storage.device_windows
        return self.inner.cache.device.type == "cuda" if windows is None else windows

    def _read_ahead_room(self) -> bool:
        """Whether one more queued batch may be mapped (its misses read) now: without device windows only the
        next `FileStorage.read_ahead` batches are; the rest of the horizon is looked at by the eviction only (rows
        held for many batches ahead shrink the cache the batches in between can use)."""
        if self._windows():
            return True
        return sum(1 for entry in self.ahead if entry.rows is not None) < self.storage.read_ahead

    def _maps_in_background(self) -> bool:
        """Whether read-ahead batches are mapped on the host cache's mapper thread, beside the forward and backward
        of the batch before them: where no device window can admit their rows (those bring the device cache's
        state into the mapping) and the device cache's slots are readable without a device sync."""
        return not self._windows() and self.inner.cache.device.type == "cpu"

    def _distinct(self, flat: torch.Tensor) -> BatchDistinct:
        """distinct() of a batch's kept lookups (ids in range, not the padding id)."""
        keep = (flat >= 0) & (flat < self.num_embeddings)
        if self.padding_idx is not None:
            keep &= flat != self.padding_idx
        every = bool(keep.all())
        return distinct(flat if every else flat[keep], groups=every and self._maps_in_background(),
                        bound=self.num_embeddings)

    def _map_ahead(self) -> None:
        """The mapper's job: the distinct ids of batches read ahead since (their cached rows marked for the
        eviction, as prefetch_targets does), then the batches due to be read ahead mapped (their misses read),
        with the unique slab rows their inner forwards would sort out."""
        for entry in self.ahead:
            if entry.distinct is None:
                entry.distinct = self._distinct(entry.flat)
                entry.found = self.host.find(entry.distinct.ids)
                self.host.expect(entry.found, entry.seq)
        self._catch_up(background=True)

    def _catch_up(self, background: bool = False) -> None:
        """Map queued read-ahead batches whose mapping paused, in order, while they fit."""
        for entry in self.ahead:
            if entry.rows is None:
                if not self._read_ahead_room() or entry.distinct is None:
                    return
                rows = self.host.map(entry.distinct.ids, entry.seq, grow=False, limit=self.host.base,
                                     background=background, found=entry.found)
                if rows is None:
                    return
                self.host.maybe_resident[rows] = True
                entry.rows = rows
                if background:
                    self.host.stats["mapped_in_background"] += 1
                    entry.inner_unique = entry.distinct.slab_unique(rows)

    def prefetch_targets(self, batch) -> list:
        """The prefetch stage (cachedemb.prefetch reads batches ahead in training order): a training-mode module
        maps `batch` now (its misses read from the file in the background, its rows held until it is done) and
        returns its slab rows for the device cache's window; else the rows its ids have now."""
        flat = batch_input(batch).reshape(-1).to(device="cpu", dtype=torch.int64)
        self.host.settle()
        if self.training and torch.is_grad_enabled() and self._maps_in_background():
            self.ahead.append(ReadAheadBatch(flat, self.seq))  # looked at and mapped on the mapper
            self.seq += 1
            return []
        batch = self._distinct(flat)
        uniq = batch.ids
        rows, seq = None, self.seq
        if self.training and torch.is_grad_enabled():
            self.seq += 1
            if all(entry.rows is not None for entry in self.ahead) and self._read_ahead_room():
                rows = self.host.map(uniq, seq, grow=False, limit=self.host.base)
            self.ahead.append(ReadAheadBatch(flat, seq, batch, rows=rows))
        if rows is None:
            rows = self.host.find(uniq)
            if self.training and torch.is_grad_enabled():
                self.host.expect(rows, seq)  # not read ahead: its cached rows are evicted last until it runs
        if not self._windows():  # the file reads run ahead; the device cache is left to its per-batch path (no windows,
            return []  # whose protection and next-use refresh would re-rank it every window)
        # Staging rows (past the budget, transient) are never announced: the pipeline sized its look-ahead
        # by the slab's rows when it started.
        rows = rows[(rows >= 0) & (rows < self.host.base)]
        self.host.announce(rows, seq)  # a window may admit them
        return [(self.inner.cache, torch.from_numpy(np.sort(rows)).to(self.inner.cache.device))]

    # ----------------------------------------------------------------- flush, snapshots, close
    def flush(self) -> None:
        """Write every updated row (device cache, then host cache) to the file (not yet a snapshot)."""
        self.host.settle()
        self.inner.flush()
        self.host.flush()

    def commit(self, **meta) -> int:
        """Flush and commit a durable snapshot of the table (returns its number); see TableFile.commit."""
        self.flush()
        return self.table.commit(dict(meta, optimizer_step=self.inner.optimizer_step))

    def rollback(self, seq: int) -> None:
        """Make the file's retained snapshot `seq` the table again (rows written since are dropped)."""
        self.host.settle()
        if seq not in self.table.snapshots:
            self.table.rollback(seq)  # raises, naming the snapshots kept
        self.host.clear()
        self.ahead.clear()
        self.table.rollback(seq)
        self.inner.optimizer_step = int(self.table.snapshots[seq][0].meta.get("optimizer_step", 0))

    def close(self) -> None:
        """Commit and close the file (also when the module is collected, or at interpreter exit): the next
        opening continues from here. After an I/O error (TableIOError) nothing more is written: the file and its
        lock are released, with a warning naming the snapshot a reopening with recover=True continues from."""
        failure = self.table.failure
        self._finalizer()
        if failure is not None and failure.reported:
            warnings.warn(f"closed table file {str(self.table.path)!r} without committing after its {failure.operation} "
                          f"failed ({failure.cause.strerror}): the rows updated since snapshot "
                          f"{failure.snapshot['seq']} are lost; open it with recover=True to continue from that "
                          "snapshot", UncommittedRowsLostWarning, stacklevel=2)

    def __getstate__(self):
        raise TypeError(f"a file-backed table (file {str(self.table.path)!r}) cannot be copied or pickled: its "
                        "state is the file. Save state_dict() (a snapshot descriptor) with cachedemb.save_checkpoint, "
                        "or export the rows (export_state_dict, to_embedding_bag)")

    # ----------------------------------------------------------------- export by streaming
    def iter_rows(self, chunk_rows: int = 1 << 16):
        """(start, weight, {state: rows}, counts) over the whole table in id order, `chunk_rows` at a time
        (current rows: flushed first)."""
        self.flush()
        yield from iter_table_rows(self.table, chunk_rows)

    def to_embedding_bag(self, device=None) -> nn.EmbeddingBag:
        """A plain nn.EmbeddingBag holding a copy of the table, filled chunk by chunk (it must fit in memory)."""
        bag = nn.EmbeddingBag(self.num_embeddings, self.embedding_dim, mode=self.mode, sparse=self.sparse,
                              include_last_offset=self.include_last_offset, padding_idx=self.padding_idx,
                              dtype=self.inner.cache.dtype, device=device or "cpu")
        with torch.no_grad():
            for start, weight, _, _ in self.iter_rows():
                bag.weight[start:start + weight.shape[0]].copy_(weight)
        return bag

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """An in-memory module's state_dict (`weight`, `optimizer.<state>`, `optimizer.step`), filled chunk by
        chunk into preallocated tensors (they must fit in memory; no second copy is made)."""
        cache = self.inner.cache
        out = {"weight": torch.empty(self.num_embeddings, self.embedding_dim, dtype=cache.dtype)}
        for name, host in cache.host_states.items():
            out[f"optimizer.{name}"] = torch.empty(self.num_embeddings, host.shape[1], dtype=host.dtype)
        for start, weight, states, _ in self.iter_rows():
            stop = start + weight.shape[0]
            out["weight"][start:stop] = weight
            for name, value in states.items():
                out[f"optimizer.{name}"][start:stop] = value
        if self.optimizer is not None:
            out["optimizer.step"] = torch.tensor(self.inner.optimizer_step, dtype=torch.int64)
        return out

    def __getattr__(self, name: str):
        if name != "weight":
            return super().__getattr__(name)
        raise AttributeError(f"a file-backed table (file {str(self.table.path)!r}) is not held in memory, so it "
                             "has no `weight` tensor: read it with iter_rows(), to_embedding_bag() or "
                             "export_state_dict()")

    # ----------------------------------------------------------------- nn.Module
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """A snapshot descriptor, not the rows: a snapshot is committed and named (see the module docstring)."""
        seq = self.commit()
        destination[prefix + "storage.uuid"] = _uuid_tensor(self.table.header.uuid)
        destination[prefix + "storage.snapshot"] = torch.tensor(seq, dtype=torch.int64)
        destination[prefix + "optimizer.step"] = torch.tensor(self.inner.optimizer_step, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        keys = [prefix + k for k in ("storage.uuid", "storage.snapshot", "optimizer.step")]
        missing = [k for k in keys if k not in state_dict]
        if missing:
            if prefix + "weight" in state_dict:
                error_msgs.append(f"{prefix}weight: a file-backed table loads a snapshot descriptor "
                                  "(storage.uuid, storage.snapshot), not rows; import rows into a new file with "
                                  "CachedEmbeddingBag.from_pretrained(rows, storage=FileStorage(new_path, ...))")
            missing_keys.extend(missing)
            return
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in keys)
        want = _uuid_of(state_dict[prefix + "storage.uuid"])
        if want != self.table.header.uuid:
            error_msgs.append(str(TableMismatchError(
                f"table file {str(self.table.path)!r} is table {self.table.header.uuid}, but the state was saved "
                f"from table {want} (another table's file)")))
            return
        seq = int(state_dict[prefix + "storage.snapshot"])
        if seq not in self.table.snapshots:
            error_msgs.append(f"table file {str(self.table.path)!r} no longer retains snapshot {seq} (it keeps "
                              f"{sorted(self.table.snapshots)})")
            return
        self.rollback(seq)
        self.inner.optimizer_step = int(state_dict[prefix + "optimizer.step"])

    def train(self, mode: bool = True):
        super().train(mode)
        self.inner.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        probe = fn(torch.zeros(1, dtype=self.inner.cache.dtype, device=self.inner.cache.device))
        if probe.dtype != self.inner.cache.dtype:
            raise TypeError(f"a file-backed table keeps the dtype of its file ({self.inner.cache.dtype}); "
                            f"convert by exporting its rows into a new file")
        self.inner._apply(fn)
        return self

    def cache_stats(self) -> dict:
        """The device cache's counters (CachedEmbeddingBag.cache_stats) plus `host_cache` (hits and misses of
        table ids in the host cache, hit_rate = hits / (hits + misses), evicted, written_back, staging_rows,
        rows, host_bytes) and `file` (rows/bytes read and written, syscalls, blocks copied on write, commits,
        file_bytes)."""
        self.host.settle()
        stats = self.inner.cache_stats()
        stats["host_cache"] = dict(self.host.stats, rows=self.host.base - self.host.first,
                                   host_bytes=self.host.host_bytes())
        stats["host_cache"]["hit_rate"] = rate_of(stats["host_cache"])
        stats["file"] = dict(self.table.stats, file_bytes=self.table.file_bytes(), log=self.table.log is not None,
                             row_map_bytes=self.table.index_bytes(),
                             **(self.table.log.stats if self.table.log is not None else {}))
        return stats

    def reset_cache_stats(self) -> None:
        self.host.settle()
        self.inner.reset_cache_stats()
        self.host.stats = dict.fromkeys(self.host.stats, 0)
        self.table.stats = dict.fromkeys(self.table.stats, 0)

    @property
    def optimizer_step(self) -> int:
        return self.inner.optimizer_step

    @property
    def cache(self):
        """The device cache (over slab rows)."""
        return self.inner.cache

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, file={str(self.table.path)!r}, "
                f"host_rows={self.host.base - self.host.first}, cache_rows={self.inner.cache.capacity}, "
                f"dtype={dtype_name(self.inner.cache.dtype)}")


def _slab_rows_within(storage: FileStorage, record: int, row_map: int, num_rows: int) -> int:
    """Host cache rows that fit in `host_cache_bytes` beside a row map of `row_map` bytes (and the padding row)."""
    rows = min(num_rows, slab_rows(storage.host_cache_bytes - row_map, record) - 1)
    if rows < 1:
        extra = f" beside the log's row map of {row_map} bytes (FileStorage(log=False) writes in place)" \
            if row_map else ""
        raise ValueError(f"FileStorage.host_cache_bytes={storage.host_cache_bytes} holds no row of {record} bytes "
                         f"with its bookkeeping and index{extra}")
    return rows


def _map_ahead_of(module_ref) -> None:
    module = module_ref()
    if module is not None:
        module._map_ahead()


def _uuid_tensor(hex_uuid: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(hex_uuid)), dtype=torch.uint8)


def _uuid_of(t: torch.Tensor) -> str:
    return bytes(t.to(torch.uint8).tolist()).hex()


def _close_table(inner: CachedEmbeddingBag, host: HostRowCache, table: TableFile) -> None:
    """Flush the device and host caches into the file, commit, release it (once). The file and its lock are
    released whatever fails; after an I/O error the table writes nothing more, and an error already raised to
    the caller is not raised again (at exit it would only be printed)."""
    if table.closed:
        return
    try:
        try:
            host.shutdown()
        except TableIOError:
            if table.failure is None or not table.failure.reported:
                raise
        if table.failure is None:
            inner.flush()
            host.flush()
            table.close({"optimizer_step": inner.optimizer_step, "closed": True})
        elif not table.failure.reported:
            raise table.failure
    finally:
        table.release()

