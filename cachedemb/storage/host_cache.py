"""The pinned host cache of a file-backed table: table ids -> rows of a bounded slab, loaded from the file.

The slab is the host table of the CachedEmbeddingBag that the file-backed module wraps, so the device cache
below keeps seeing dense host rows (slab rows) and its kernels are unchanged. Per batch (O(its distinct ids)):

    distinct ids -> RowIndex (exact, host) -> hits: their slab rows
                 -> misses: free rows, else evict a batch of rows (LFU: lowest access count, then least recently
                    used; never a row this batch or a batch read ahead still uses; under prefetch, rows the
                    rest of the horizon reads go last) -> read their records from the
                    file into the slab (thread pool; asynchronous under prefetch, the window admission waits for
                    them through `EmbeddingCache.host_fence`)

Evicting a row first writes back a device-resident copy and empties its slot (`EmbeddingCache.drop_rows`),
then, if the row was written since it was read, queues its record for the file (write-backs go out in batches
on the writer thread, which also packs their records from the slab: a load into a victim's slab row waits for
the packs issued before it; a row being written is read back only after its write lands). The LFU score is the
row's access count, which travels with the row in its record, so it survives evictions.

A batch with more distinct ids than the slab has rows still runs exactly: the slab grows by the missing rows
for that batch (`CachedEmbeddingBag._resize_rows`, transient staging rows past the budget) and shrinks back at
the next batch that does not need them.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from cachedemb.kernels.host_sort import stable_sort, unique_of_sort
from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.storage import inner_unique, record_copy
from cachedemb.storage.record_copy import RecordFields
from cachedemb.storage.row_index import RowIndex
from cachedemb.storage.slab_victims import victim_keys
from cachedemb.storage.table_file import DeferredRecords, IoTicket, TableFile

# An eviction frees at least 1/EVICT_FRACTION of the slab, so its O(slab) ranking and fixed costs are amortized.
# 8M rows, 1/16 host cache, 2 cores (profile runs, alternating): 1/8 36.7-40.7 ms a step, 1/16 39.0-48.0,
# 1/4 42.6-43.4 (rows freed early sit empty: 2.6% more reads), 1/32 42.4-45.7; rows read alike at 1/8 and 1/16.
EVICT_FRACTION = 8
WRITE_ROWS = 1 << 14  # rows per write-back batch


@dataclass
class BatchDistinct:
    """A batch's distinct ids (ascending), each lookup's position among them, and the stable sort they came from
    (its permutation and the run lengths), kept to hand the inner forward its unique slab rows."""

    ids: np.ndarray
    inverse: np.ndarray
    perm: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    def slab_unique(self, rows: np.ndarray) -> tuple | None:
        """What the inner forward's `unique_ids` returns for the batch's lookups mapped to the distinct slab rows
        `rows` (one per distinct id), from this sort (cachedemb/storage/inner_unique.py); None without it."""
        if self.perm is None or rows.size == 0:
            return None
        return inner_unique.slab_unique(rows, self.inverse, self.perm, self.counts)


def distinct(ids: torch.Tensor, groups: bool = False, bound: int | None = None) -> BatchDistinct:
    """The distinct ids of a 1-D int64 host tensor, as `np.unique(..., return_inverse=True)` answers, through the
    packed-key sort (kernels/host_sort.py), about half its time; `groups`: the sort kept too; `bound`: every id
    is in [0, bound) (spares the sort a min/max pass)."""
    ids = ids.reshape(-1).to(torch.int64)
    if ids.numel() < 2:
        return BatchDistinct(ids.numpy().copy(), np.zeros(ids.numel(), dtype=np.int64))
    s_ids, s_perm = stable_sort(ids, None if bound is None else (0, max(bound - 1, 0)))
    if not groups:
        uniq, inverse = unique_of_sort(s_ids, s_perm)
        return BatchDistinct(uniq.numpy(), inverse.numpy())
    uniq, inverse, counts = unique_of_sort(s_ids, s_perm, counts=True)
    return BatchDistinct(uniq.numpy(), inverse.numpy(), s_perm.to(torch.int64), counts.to(torch.int64))


def _positions_in(ids: np.ndarray, ascending: np.ndarray) -> np.ndarray:
    """Where each of `ids` sits in the ascending array (a write-back's ids), -1 where absent: a binary search
    per id."""
    if ascending.size == 0:
        return np.full(ids.size, -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(ascending, ids), ascending.size - 1)
    return np.where(ascending[at] == ids, at, -1)


BOOKKEEPING_BYTES = 43  # per slab row: id, last batch, next known use, load serial, window (8 B each); dirty, free, resident


def slab_rows(host_cache_bytes: int, record_bytes: int) -> int:
    """The most slab rows whose records, bookkeeping and index fit in `host_cache_bytes`."""
    best, size = 0, 16
    while 8 * size < host_cache_bytes:
        rows = min(size // 4, (host_cache_bytes - 8 * size) // (record_bytes + BOOKKEEPING_BYTES))  # RowIndex
        best = max(best, rows)
        size *= 2
    return best


class HostRowCache:
    """Slab rows [first, first + rows) of `inner`'s host table, holding table rows from `table`."""

    def __init__(self, table: TableFile, inner: CachedEmbeddingBag, rows: int, first: int):
        self.table, self.inner = table, inner
        self.layout = table.layout
        self.first, self.base = first, first + rows
        self.index = RowIndex(rows)
        self._alloc_arrays(self.base)
        self.free_mask[:first] = False
        self.done_below = 0  # batches with a lower sequence number have run forward and backward
        self.loads: list[IoTicket] = []  # loads not waited for, oldest first
        self.load_serial = 0  # loads issued so far; row_load[r]: the one that fills row r
        self.writes: list[tuple[np.ndarray, DeferredRecords, IoTicket]] = []  # (ids ascending, records, ticket)
        self.packs: list[DeferredRecords] = []  # write-backs maybe not packed yet (loads into their rows wait)
        self._fields_key, self._record_fields = None, None  # `_fields`: the slab tensors it was built for, it
        # The mapper: one thread mapping read-ahead batches while the training thread runs a forward and backward
        # (see `run_in_background`); `resident`: the device cache's rows when that started, which it leaves alone.
        self._mapper: ThreadPoolExecutor | None = None
        self._mapper_thread: threading.Thread | None = None
        self._mapping: Future | None = None
        self.resident: np.ndarray | None = None
        self.stats = dict.fromkeys(("hits", "misses", "evicted", "written_back", "from_writes", "staging_rows",
                                    "grown", "mapped_in_background"), 0)

    def _alloc_arrays(self, n: int) -> None:
        self.row_load = np.zeros(n, dtype=np.int64)
        self.maybe_resident = np.zeros(n, dtype=bool)  # handed to the device cache since its copy was dropped
        self.announced = np.full(n, -1, dtype=np.int64)  # the last read-ahead batch whose window may admit it
        self.row_id = np.full(n, -1, dtype=np.int64)
        self.row_step = np.full(n, -1, dtype=np.int64)  # the last batch (sequence number) that reads the row
        self.next_use = np.full(n, -1, dtype=np.int64)  # the last horizon batch seen to read it (not held)
        self.dirty = np.zeros(n, dtype=bool)
        self.free_mask = np.ones(n, dtype=bool)

    @property
    def num_rows(self) -> int:
        return self.row_id.size

    @property
    def cache(self):
        return self.inner.cache

    # ----------------------------------------------------------------- mapping
    def find(self, uniq: np.ndarray) -> np.ndarray:
        """Slab row of each id, -1 where it is not in the host cache (read-only)."""
        return self.index.lookup(uniq)

    def _still_found(self, uniq: np.ndarray, found: np.ndarray) -> np.ndarray:
        rows = found.copy()
        again = np.flatnonzero((rows < 0) | (self.row_id[rows] != uniq))
        rows[again] = self.find(uniq[again])
        return rows

    def _live(self):
        rows = np.flatnonzero(self.row_id >= 0)
        return self.row_id[rows], rows

    def map(self, uniq: np.ndarray, seq: int | None, grow: bool, limit: int | None = None,
            now: bool = False, background: bool = False, found: np.ndarray | None = None) -> np.ndarray | None:
        """Slab rows for distinct ids `uniq` (missing ones allocated and read from the file, asynchronously);
        rows are held for batch `seq` (None: this forward only). Without `grow`, None when the rows
        (below `limit`) cannot all be found (nothing is then allocated). `now`: the forward waits for the rows
        at once (the calling thread reads a share of them, TableFile.read's `here`). `background`: on the
        mapper, beside a forward: rows the device cache holds (`resident`) are neither evicted nor reused.
        `found`: `find(uniq)` as it answered earlier (only the ids it missed, or whose rows changed hands since,
        are looked up again)."""
        if background and self.resident is None:
            return None
        rows = self.find(uniq) if found is None else self._still_found(uniq, found)
        miss = np.flatnonzero(rows < 0)
        if miss.size:
            limit = self.num_rows if limit is None else limit
            short = miss.size - int(np.count_nonzero(self._usable(limit, background)))
            if short > 0:
                keep = rows[rows >= 0]
                self._evict(short, keep=np.concatenate([keep, self.resident]) if background else keep)
                short = miss.size - int(np.count_nonzero(self._usable(limit, background)))
            if short > 0:
                if not grow:
                    return None
                self._grow(short)
            new = np.flatnonzero(self._usable(self.num_rows if grow else limit, background))[: miss.size]
            # A free row may still be device-resident: a prefetch window can admit rows read ahead before
            # they were evicted. Its copy goes before the row takes another id (and after the write-back
            # reading the row is packed).
            if self.maybe_resident[new].any():
                self.finish_packs()
            self.drop_device_copies(new)
            ids = uniq[miss]
            self.index.insert(ids, new, self._live)
            self.free_mask[new] = False
            self.row_id[new] = ids
            self.row_step[new] = -1
            self.dirty[new] = False
            self._load(ids, new, now)
            rows[miss] = new
        self.stats["hits"] += int(uniq.size - miss.size)
        self.stats["misses"] += int(miss.size)
        if seq is not None:
            self.row_step[rows] = np.maximum(self.row_step[rows], seq)
        return rows

    def _usable(self, limit: int, background: bool) -> np.ndarray:
        """Free rows below `limit` a new id may take (on the mapper: none the device cache may hold)."""
        free = self.free_mask[:limit]
        return free & ~self.maybe_resident[:limit] if background else free

    # ----------------------------------------------------------------- the mapper
    def run_in_background(self, job) -> None:
        """Run `job` (mapping read-ahead batches) on the mapper thread, after the one before it. It may touch
        this cache's state, the file and the slab rows outside `resident` and the batches in flight; the
        training thread touches the rest (its forward and backward in the device cache) meanwhile and calls
        `settle` before it uses this cache again."""
        self.settle()
        if self._mapper is None:
            self._mapper = ThreadPoolExecutor(1, thread_name_prefix="cachedemb-map")
            self._mapper_thread = self._mapper.submit(threading.current_thread).result()
        self._mapping = self._mapper.submit(job)

    def settle(self) -> None:
        """Wait for the mapper's job (its error raised here); a no-op on the mapper itself."""
        if self._mapping is None or threading.current_thread() is self._mapper_thread:
            return
        job, self._mapping = self._mapping, None
        job.result()

    def note_residency(self) -> None:
        """Mark exactly the rows the device cache holds now as `maybe_resident` (where no prefetch window can
        admit rows behind the forward's back): the mapper then leaves them to the training thread."""
        cache = self.cache
        ids = cache.slot_ids[: cache.capacity].numpy()
        self.resident = ids[ids >= 0]
        self.maybe_resident[:] = False
        self.maybe_resident[self.resident] = True

    def shutdown(self) -> None:
        """Wait for the mapper's job and end its thread (from the mapper itself, as a finalizer may run there:
        without joining it)."""
        on_mapper = threading.current_thread() is self._mapper_thread
        try:
            self.settle()
        finally:
            if self._mapper is not None:
                self._mapper.shutdown(wait=not on_mapper)
                self._mapper = self._mapper_thread = None

    def _load(self, ids: np.ndarray, rows: np.ndarray, now: bool = False) -> None:
        """Read rows `ids` into slab `rows` on the pool. A row whose write-back is still in flight is copied from
        that write's records (the bytes the file will hold; the newest write where it is in several) instead
        of waiting for the write and reading it back."""
        self.writes = [(w, r, t) for w, r, t in self.writes if not t.done()]
        cache, layout = self.cache, self.layout
        fields = self._fields()

        def land(records: torch.Tensor, at: torch.Tensor, order: torch.Tensor | None = None) -> None:
            """records[i] into slab row at[i] (at[order[i]] with `order`); the rows are disjoint."""
            if fields is not None:  # one C pass, no GIL held (this runs on the reader threads too)
                fields.land(records, at, order)
                return
            if order is not None:
                at = at.index_select(0, order)
            cache.host_weight.index_copy_(0, at, layout.weight_view(records))
            for name in cache.host_states:
                cache.host_states[name].index_copy_(0, at, layout.state_view(records, name))
            cache.host_freq.index_copy_(0, at, layout.count_view(records))

        served = np.zeros(ids.size, dtype=bool)
        for written, records, _ in reversed(self.writes):  # newest first
            at = _positions_in(ids, written)
            take = (at >= 0) & ~served
            if take.any():
                self.finish_packs()  # the rows may land where a write-back not yet packed reads
                land(records.get().index_select(0, torch.from_numpy(at[take])), torch.from_numpy(rows[take]))
                served |= take
        if served.any():
            self.row_load[rows[served]] = 0  # in place now: nothing to wait for
            ids, rows = ids[~served], rows[~served]
            self.stats["from_writes"] += int(served.sum())
        if ids.size == 0:
            return
        dest = torch.from_numpy(rows)
        self.packs = packs = [p for p in self.packs if not p.ready]

        def land_after_packs(records: torch.Tensor, order: torch.Tensor) -> None:
            for pack in packs:  # slab rows evicted just now are packed (here, if no one did yet) before reuse
                pack.get()
            land(records, dest, order)

        self.loads.append(self.table.read(ids, sink=land_after_packs, here=now))
        self.load_serial += 1
        self.row_load[rows] = self.load_serial

    def _fields(self) -> RecordFields | None:
        """The record <-> slab row copier for the slab's current tensors (rebuilt when the slab moves), or None
        where the C pass does not apply (the torch code runs)."""
        cache = self.cache
        tensors = [cache.host_weight] + [cache.host_states[n] for n in sorted(cache.host_states)] + [cache.host_freq]
        key = tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)
        if self._fields_key != (key, record_copy.NATIVE.enabled):
            self._fields_key = (key, record_copy.NATIVE.enabled)
            self._record_fields = RecordFields.of(self.layout, cache.host_weight, cache.host_states, cache.host_freq)
        return self._record_fields

    def fence(self, rows=None) -> None:
        """Wait until the rows being read into `rows` (default: every row) are in the slab: before the device
        cache reads slab rows. Loads land in any order; this waits for every load up to the newest one that
        fills one of `rows`."""
        self.settle()
        if rows is not None:
            rows = rows.numpy() if torch.is_tensor(rows) else np.asarray(rows)
            newest = int(self.row_load[rows].max()) if rows.size else 0
            keep = self.load_serial - newest  # loads issued after it are not needed here
        else:
            keep = 0
        if keep >= len(self.loads):
            return
        wait, self.loads = self.loads[: len(self.loads) - keep], self.loads[len(self.loads) - keep:]
        for ticket in wait:
            ticket.wait()

    # ----------------------------------------------------------------- eviction and write-back
    def _evict(self, need: int, keep: np.ndarray) -> None:
        """Free at least `need` rows (a batch of them: at least 1/EVICT_FRACTION of the slab) among rows no
        batch in flight holds and not in `keep`: lowest access count first, then least recently used."""
        cand, key = victim_keys(self.row_id, self.row_step, self.next_use, self.cache.host_freq.numpy(),
                                self.done_below, keep)
        if cand.size == 0:
            return
        want = min(cand.size, max(need, (self.base - self.first) // EVICT_FRACTION))
        if want < cand.size:
            cand = cand[np.argpartition(key, want - 1)[:want]]
        self.evict_rows(cand)

    def evict_rows(self, rows: np.ndarray) -> None:
        """Drop these slab rows: device copies written back and emptied, dirty rows queued for the file."""
        if rows.size == 0:
            return
        # A row still being read must land before it is written back or reused. Only the victims' loads are
        # waited for (older ones; the read-ahead batches' loads in flight fill held rows, never victims).
        self.fence(rows)
        cache = self.cache
        self.drop_device_copies(rows)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)  # the write-backs above land in the slab before it is read
        self.write_back(rows[self.dirty[rows]])
        self.index.delete(self.row_id[rows])
        self.row_id[rows] = -1
        self.row_step[rows] = -1
        self.next_use[rows] = -1
        self.free_mask[rows] = True
        self.stats["evicted"] += int(rows.size)

    def drop_device_copies(self, rows: np.ndarray) -> None:
        """Write back and empty the device cache's copies of these slab rows (only rows handed to it since
        their copies were last dropped: `maybe_resident`)."""
        rows = rows[self.maybe_resident[rows]]
        if rows.size:
            self.cache.drop_rows(torch.from_numpy(rows))
            # A window not admitted yet (its batches not reached) may still bring the row back.
            self.maybe_resident[rows] = self.announced[rows] > self.done_below

    def expect(self, rows: np.ndarray, seq: int) -> None:
        """Rows (-1: not cached) that batch `seq` of the prefetch horizon will read: evicted last until it runs."""
        rows = rows[rows >= 0]
        self.next_use[rows] = np.maximum(self.next_use[rows], seq)

    def announce(self, rows: np.ndarray, seq: int) -> None:
        """Rows handed to the prefetch pipeline for batch `seq`: a window may admit them until that batch runs."""
        self.maybe_resident[rows] = True
        self.announced[rows] = np.maximum(self.announced[rows], seq)

    def write_back(self, rows: np.ndarray) -> None:
        """Queue the records of slab `rows` for the file, in id order and batches of WRITE_ROWS. They are packed
        off this thread (by the writer, or by the reader that lands rows in a victim's slab row first: loads
        wait for the packs issued before them), and memory in flight stays bounded."""
        if rows.size == 0:
            return
        rows = rows[np.argsort(self.row_id[rows])]  # distinct ids: any sort is the stable one (5x a stable sort)
        cache = self.cache
        fields = self._fields()
        for start in range(0, rows.size, WRITE_ROWS):
            part = rows[start: start + WRITE_ROWS]
            at = torch.from_numpy(part)
            if fields is not None:  # one C pass instead of a gather and a copy per field
                records = DeferredRecords(lambda at=at: fields.pack(at))
            else:
                records = DeferredRecords(lambda at=at, w=cache.host_weight, st=dict(cache.host_states),
                                          f=cache.host_freq: self.layout.pack(
                                              w.index_select(0, at), {n: s.index_select(0, at) for n, s in st.items()},
                                              f.index_select(0, at)))
            self.packs.append(records)
            ids = self.row_id[part]
            self.writes.append((ids, records, self.table.write(ids, records)))
            if len(self.writes) > 4:  # at most a few batches of records in flight
                self.writes[0][2].wait()
                self.writes = [(w, r, t) for w, r, t in self.writes if not t.done()]
        self.dirty[rows] = False
        self.stats["written_back"] += int(rows.size)

    def finish_packs(self) -> None:
        """Pack every write-back not packed yet (before the slab rows they read change or move)."""
        for pack in self.packs:
            pack.get()
        self.packs = []

    def flush(self) -> None:
        """Every dirty slab row to the file (rows stay cached, clean); the device cache must be flushed first."""
        self.settle()
        self.fence()
        self.write_back(np.flatnonzero(self.dirty))
        self.table.drain()
        self.writes = []

    def clear(self) -> None:
        """Forget every cached row (after a flush, or to drop rows the file no longer holds): the device cache
        is emptied of them too."""
        self.settle()
        self.fence()
        self.drop_device_copies(np.arange(self.num_rows))
        self.index = RowIndex(self.base - self.first)
        self.row_id[:] = -1
        self.row_step[:] = -1
        self.next_use[:] = -1
        self.dirty[:] = False
        self.free_mask[:] = True
        self.free_mask[: self.first] = False

    # ----------------------------------------------------------------- staging rows
    def _grow(self, extra: int) -> None:
        """Room for `extra` more rows past the slab (a batch larger than the host cache)."""
        self.fence()
        self.finish_packs()
        old = self.num_rows
        new = old + extra
        self.inner._resize_rows(new)
        for name, fill in (("row_id", -1), ("row_step", -1), ("next_use", -1)):
            setattr(self, name, np.concatenate([getattr(self, name), np.full(extra, fill, dtype=np.int64)]))
        self.dirty = np.concatenate([self.dirty, np.zeros(extra, dtype=bool)])
        self.maybe_resident = np.concatenate([self.maybe_resident, np.zeros(extra, dtype=bool)])
        self.announced = np.concatenate([self.announced, np.full(extra, -1, dtype=np.int64)])
        self.row_load = np.concatenate([self.row_load, np.zeros(extra, dtype=np.int64)])
        self.free_mask = np.concatenate([self.free_mask, np.ones(extra, dtype=bool)])
        self.stats["staging_rows"] = max(self.stats["staging_rows"], new - self.base)
        self.stats["grown"] += 1

    def trim(self) -> None:
        """Give the staging rows back once no batch in flight holds them (the slab returns to its budget)."""
        if self.num_rows <= self.base:
            return
        staging = np.arange(self.base, self.num_rows)
        if (self.row_step[staging] >= self.done_below).any():
            return
        self.evict_rows(staging[self.row_id[staging] >= 0])
        self.finish_packs()
        self.table.drain()
        self.writes = []
        self.inner._resize_rows(self.base)
        for name in ("row_id", "row_step", "next_use", "dirty", "free_mask", "maybe_resident", "announced",
                     "row_load"):
            setattr(self, name, getattr(self, name)[: self.base].copy())

    def host_bytes(self) -> int:
        """Host memory this cache holds: slab rows (row, state, count) and its bookkeeping."""
        return self.num_rows * (self.layout.record_bytes + BOOKKEEPING_BYTES) + self.index.nbytes
