"""A table file: rows read and written in batches on a thread pool, copy-on-write after each commit.

Reads and writes are batched and sorted by file offset; runs of adjacent records go in one pread / pwrite call
(`rowio`: a loop in C under one GIL-free ctypes call, or `os.preadv` / `os.pwritev` in Python), and the calls run
on worker threads: reads on up to `io_threads` workers, writes on `write_threads` (default: one per four cores, at
most `io_threads // 2`, at least one), each writer owning the chunks c = k mod writers, so every row's writes land
in submission order. A written record costs ~1.5 us of kernel time (the page dirtied), so one writer caps the rows
written per second; on a machine with few cores more writers only take turns with the training thread.

A read is split over the readers only while the file's records come from the disk (lately more than
`COLD_SHARE` of the records read needed a page from the storage layer: the reading thread's block input,
getrusage(RUSAGE_THREAD), which CPU contention does not inflate as it does wall time): blocked readers cost no
CPU and keep several requests in flight. From a warm page cache a read is CPU work, and parallel parts only take
turns with the training thread (a 1/16-cache step on 2 cores: 43-45 ms with two or four parts, 38 with one), so
it goes in one part. A read the caller waits for at once (`here`) gives a share to the caller's own thread either
way.

A chunk (the rows of one block) that a retained snapshot names is never written: its first write after a commit
copies the block into a free one (through a 64 KiB buffer), and the live chunk map points there from then on.

The file is read at random (`POSIX_FADV_RANDOM`: no read-ahead) and every write that creates its pages (creation,
copy-on-write, long runs) goes in page-sized pieces (`rowio`), so the page cache holds the table in 4 KiB
folios: a record rewritten into a large folio costs ~5x the kernel time (ext4 walks every block of the folio;
`copy_file_range` and one large write both create large folios).

Commit (`commit`): wait for every read and write, `fdatasync`, write the live chunk map into free blocks,
`fdatasync`, overwrite the superblock slot of the older retained snapshot, `fdatasync`. The file then retains
the new snapshot and the one before it; blocks only the dropped one named become free.

Opening checks everything a crash or a wrong path can leave: the magic and header checksum, the superblocks'
checksums, that every block a snapshot names lies inside the file (a truncated file fails here), and, when the
caller says what it expects, the table's shape, dtype and optimizer state layout. A writer that did not close
the file (a crash, a SIGKILL) leaves its writer record set: opening says so and offers the last snapshot
(`recover=True`). An `flock` tells a live writer from a dead one.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import secrets
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from cachedemb.modules.checkpoint import fsync_directory
from cachedemb.storage import rowio
from cachedemb.storage.log_structure import RowLog, block_counts, chunk_map_positions, position_dtype
from cachedemb.storage.format import (
    DATA_OFFSET,
    PAGE,
    SUPER_OFFSETS,
    WRITER_OFFSET,
    CorruptTableError,
    Superblock,
    TableHeader,
    TableIOError,
    TableLockedError,
    TableMismatchError,
    TableWriterDiedError,
    WriterRecord,
)

# Row fill for creation: rows [start, stop) -> (weight [n, dim], {state: [n, cols]}, counts [n]).
RowFill = Callable[[int, int], tuple]
_FILL_BYTES = 4 << 20  # creation streams the table through a buffer of about this size
# Reads split over the readers while more than this share of the records read lately came from the disk.
COLD_SHARE = 0.25
_BLOCK_IN = 512  # ru_inblock counts 512-byte blocks


class IoTicket:
    """Completion of one batched read or write (several futures); `wait()` returns the read's records."""

    def __init__(self, futures: list[Future] | None, result=None):
        self.futures, self._result = futures, result  # futures None: a read registered before it is issued

    def done(self) -> bool:
        return self.futures is not None and all(f.done() for f in self.futures)

    def wait(self):
        for f in self.futures:
            try:
                f.result()
            except TableIOError as error:
                error.reported = True  # it reaches the thread that waits: the caller's
                raise
        return self._result


class DeferredRecords:
    """A write's records, made by whichever thread needs them first (the writer, or a reader about to land rows
    where they come from): the write-back of evicted host-cache rows is packed off the training thread."""

    def __init__(self, make: Callable[[], torch.Tensor]):
        self._make, self._lock, self._records = make, threading.Lock(), None

    @property
    def ready(self) -> bool:
        return self._records is not None

    def get(self) -> torch.Tensor:
        if self._records is None:
            with self._lock:
                if self._records is None:
                    self._records = self._make()
                    self._make = None
        return self._records


class TableFile:
    """One table file open for reading or writing (see the module docstring)."""

    def __init__(self, path: Path, fd: int, header: TableHeader, writable: bool, io_threads: int,
                 write_threads: int | None = None):
        self.path, self.fd, self.header, self.writable = path, fd, header, writable
        self.layout = header.layout
        self.record = self.layout.record_bytes
        self.block = header.block_bytes
        self.rpb = header.rows_per_block
        self.snapshots: dict[int, tuple[Superblock, np.ndarray | None]] = {}  # seq -> (superblock, chunk map)
        self.pins: dict[int, np.ndarray] = {}  # seq -> blocks holding a record the snapshot names
        self.log: RowLog | None = None  # log mode: rows appended, a position per row (log_structure.py)
        self.data_offset = DATA_OFFSET
        self._reads: list[IoTicket] = []  # reads that may be in flight (a block emptied meanwhile waits for them)
        self.slot_of: dict[int, int] = {}  # seq -> superblock slot
        self.live: np.ndarray = np.zeros(0, dtype=np.int64)
        self.used = np.zeros(0, dtype=bool)
        self.free: list[int] = []
        self._map_lock = threading.Lock()
        self._readers = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="cachedemb-read")
        self.disk_share: float | None = None  # of the records read lately, the share read from the disk
        # One thread per writer: a writer's tasks run in submission order, and a chunk always goes to one writer.
        self._writers = [ThreadPoolExecutor(1, thread_name_prefix="cachedemb-write")
                         for _ in range(write_threads or default_writers(io_threads))]
        self._alloc_lock = threading.Lock()  # block allocation and file growth (copy-on-write on several writers)
        self._stats_lock = threading.Lock()
        self._pending: list[IoTicket] = []
        self.token = 0
        self.writer_died: WriterRecord | None = None
        self.stats = dict.fromkeys(("rows_read", "rows_written", "bytes_read", "bytes_written", "read_calls",
                                    "gap_bytes_read", "write_calls", "blocks_copied", "commits"), 0)
        self.closed = False
        self.failure: TableIOError | None = None  # the first refused I/O call: the live table is lost since

    # ----------------------------------------------------------------- I/O errors
    @contextlib.contextmanager
    def _io(self, operation: str):
        """Run I/O calls of `operation` ("write-back", "cleaning", "read", "commit", "close"): an OSError of
        theirs becomes the table's TableIOError (the first one is kept; the table refuses every later use)."""
        try:
            yield
        except TableIOError:
            raise
        except OSError as error:
            if error.errno is None:
                raise
            if self.failure is None:
                self.failure = TableIOError(self.path, operation, error, self.describe_snapshot(self.newest_seq))
            raise self.failure from error

    def _check_usable(self) -> None:
        if self.failure is not None:
            self.failure.reported = True
            raise self.failure

    # ----------------------------------------------------------------- creation and opening
    @classmethod
    def create(cls, path, header: TableHeader, fill: RowFill, io_threads: int = 4,
               write_threads: int | None = None, log: bool = False, log_slack: float = 0.5) -> "TableFile":
        """Write a new table file at `path` (which must not exist), its rows from `fill` in chunks of blocks
        (never the whole table in memory), committed as snapshot 1; returned open for writing. The file is
        built under a temporary name and renamed into place, so a crash never leaves a partial `path`.
        `log`: write-backs append (log_structure.py) instead of rewriting records in place."""
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"table file {str(path)!r} already exists; cachedemb never overwrites one "
                                  "(open it, or choose another path)")
        if not path.parent.is_dir():
            raise FileNotFoundError(f"directory {str(path.parent)!r} of table file {str(path)!r} does not exist")
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.creating")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        table = cls(path, fd, header, True, io_threads, write_threads)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _advise_random(fd)
            os.pwrite(fd, header.encode(), 0)
            table._write_writer_record(True)
            for slot in SUPER_OFFSETS:
                os.pwrite(fd, b"\0" * PAGE, slot)
            n_chunks = header.num_chunks
            table.live = np.arange(n_chunks, dtype=np.int64)
            table.used = np.ones(n_chunks, dtype=bool)
            per_fill = max(1, _FILL_BYTES // table.block) * table.rpb
            for start in range(0, header.num_rows, per_fill):
                stop = min(header.num_rows, start + per_fill)
                weight, states, counts = fill(start, stop)
                data = memoryview(table.layout.pack(weight, states, counts).numpy()).cast("B")
                for first in range(start, stop, table.rpb):  # chunk c in block c (blocks are page-aligned)
                    last = min(stop, first + table.rpb)
                    table._pwrite_all(data[(first - start) * table.record: (last - start) * table.record],
                                      DATA_OFFSET + (first // table.rpb) * table.block)
            if header.num_rows == 0:
                os.ftruncate(fd, DATA_OFFSET + table.block)
            else:  # the last block in full, so every block a map names lies inside the file
                os.ftruncate(fd, max(os.fstat(fd).st_size, DATA_OFFSET + n_chunks * table.block))
            if log:
                dtype = position_dtype(header.num_rows, table.rpb)
                table.log = RowLog(table, np.arange(header.num_rows, dtype=dtype), log_slack)
            table._commit_map({"optimizer_step": 0, "created": True})
            if table.log is not None:
                table.log.commits = 0  # the creation's snapshot pins every block: it counts as the one opened
            os.replace(tmp, path)
            fsync_directory(path.parent)
        except BaseException:
            table._shutdown()
            os.close(fd)
            with _suppress():
                os.unlink(tmp)
            raise
        return table

    @classmethod
    def open(cls, path, writable: bool = True, recover: bool = False, expect: TableHeader | None = None,
             io_threads: int = 4, write_threads: int | None = None, log: bool | None = None,
             log_slack: float = 0.5) -> "TableFile":
        """Open an existing table file, checking its structure (and, with `expect`, that it holds that table).
        A file whose writer died raises TableWriterDiedError naming the last snapshot, unless `recover`: then
        it opens at that snapshot (the rows written after it are gone). `log`: True turns a file written in
        place into a log from its next commit on; a file that is a log (a retained snapshot with a row map)
        stays one whatever `log` says."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"table file {str(path)!r} not found")
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if writable else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                rec = WriterRecord.decode(os.pread(fd, PAGE, WRITER_OFFSET))
                who = f"pid {rec.pid} on {rec.host}" if rec and rec.open else "another process"
                raise TableLockedError(f"table file {str(path)!r} is open for writing by {who}; one writer at "
                                       "a time (readers wait for it to close)") from None
            size = os.fstat(fd).st_size
            if size < DATA_OFFSET:
                raise CorruptTableError(f"table file {str(path)!r} is truncated: {size} bytes, less than its "
                                        f"{DATA_OFFSET}-byte preamble")
            header = TableHeader.decode(os.pread(fd, PAGE, 0), path)
            if expect is not None:
                _check_expected(path, header, expect)
            table = cls(path, fd, header, writable, io_threads, write_threads)
            table._load_snapshots(size)
            rec = WriterRecord.decode(os.pread(fd, PAGE, WRITER_OFFSET))
            if rec is None or rec.open:
                newest = table.newest_seq
                info = table.describe_snapshot(newest)
                if not recover:
                    who = f"pid {rec.pid} on {rec.host}, open since {time.ctime(rec.since)}" if rec else \
                        "a writer whose record is torn"
                    how = "it died" if rec is None or (rec.pid, rec.host) != (os.getpid(), socket.gethostname()) \
                        else "this process released it after an I/O error"
                    raise TableWriterDiedError(
                        f"table file {str(path)!r} was not closed by its last writer ({who}): {how}, and rows "
                        f"it wrote after its last commit are lost. The last committed snapshot is intact: "
                        f"snapshot {newest} ({info}). Open with recover=True (FileStorage(..., recover=True) or "
                        "open_table(..., recover=True)) to continue from it.", info)
                table.writer_died = rec or WriterRecord(True)
            if log or table.is_log_file():
                table.log = RowLog(table, table._snapshot_positions(table.newest_seq), log_slack)
            else:
                table.live = table.snapshots[table.newest_seq][1].copy()
            table._rebuild_free()
            if writable:
                table._write_writer_record(True)
                os.fsync(fd)
            _advise_random(fd)
            return table
        except BaseException:
            if "table" in locals():
                table._shutdown()
            os.close(fd)
            raise

    def _load_snapshots(self, size: int) -> None:
        supers = []
        for slot, offset in enumerate(SUPER_OFFSETS):
            sb = Superblock.decode(os.pread(self.fd, PAGE, offset))
            if sb is not None:
                supers.append((sb, slot))
        if not supers:
            raise CorruptTableError(f"table file {str(self.path)!r} has no valid superblock (no committed "
                                    "snapshot: a damaged or foreign file)")
        supers.sort(key=lambda s: -s[0].seq)
        n_chunks = self.header.num_chunks
        problems = []
        for sb, slot in supers:
            problem = None
            end_blocks = DATA_OFFSET + sb.high_water * self.block
            row_map = sb.meta.get("row_map")
            want = np.dtype(row_map).itemsize * self.header.num_rows if row_map in ("int32", "int64") \
                else 8 * n_chunks
            if row_map is not None and row_map not in ("int32", "int64"):
                problem = f"its row map has dtype {row_map!r}, expected int32 or int64"
            elif sb.map_bytes != want:
                problem = f"its {'row' if row_map else 'chunk'} map has {sb.map_bytes} bytes, expected {want}"
            elif sb.map_offset + sb.map_bytes > size or end_blocks > size:
                problem = (f"it needs {max(sb.map_offset + sb.map_bytes, end_blocks)} bytes but the file has "
                           f"{size} (truncated)")
            if problem is None and row_map is None:
                chunk_map = np.frombuffer(os.pread(self.fd, sb.map_bytes, sb.map_offset), dtype=np.int64).copy()
                if chunk_map.size != n_chunks or (chunk_map.size and (chunk_map.min() < 0 or
                                                                      chunk_map.max() >= sb.high_water)):
                    problem = "its chunk map names blocks outside the file"
                pins = chunk_map
            elif problem is None:
                chunk_map = None
                try:
                    counts = block_counts(self._read_row_map(sb), self.rpb, sb.high_water)
                except CorruptTableError as exc:  # the other snapshot may still stand
                    problem, counts = str(exc), np.zeros(0, dtype=np.int64)
                if problem is None and counts.size > sb.high_water:
                    problem = "its row map names records outside the file"
                pins = np.flatnonzero(counts)
            if problem is None:
                self.snapshots[sb.seq] = (sb, chunk_map)
                self.pins[sb.seq] = pins
                self.slot_of[sb.seq] = slot
            else:
                problems.append(f"snapshot {sb.seq}: {problem}")
        if not self.snapshots or max(self.snapshots) != supers[0][0].seq:
            raise CorruptTableError(f"table file {str(self.path)!r} is damaged: " + "; ".join(problems))

    # ----------------------------------------------------------------- snapshots
    @property
    def newest_seq(self) -> int:
        return max(self.snapshots)

    def is_log_file(self) -> bool:
        return any(sb.meta.get("row_map") for sb, _ in self.snapshots.values())

    def _read_row_map(self, sb: Superblock) -> np.ndarray:
        """A snapshot's row map, read straight into its array (no second copy in memory)."""
        loc = np.empty(self.header.num_rows, dtype=np.dtype(sb.meta["row_map"]))
        view, offset = memoryview(loc).cast("B"), sb.map_offset
        while view.nbytes:
            got = os.preadv(self.fd, [view[: 1 << 26]], offset)
            if got <= 0:
                raise CorruptTableError(f"table file {str(self.path)!r}: the file ends inside the row map of "
                                        f"snapshot {sb.seq} (truncated while open?)")
            view, offset = view[got:], offset + got
        if loc.size and loc.min() < 0:
            raise CorruptTableError(f"table file {str(self.path)!r}: snapshot {sb.seq}'s row map names negative "
                                    "positions")
        return loc

    def _snapshot_positions(self, seq: int) -> np.ndarray:
        """Snapshot `seq` as a position per row (a chunk-map snapshot converted)."""
        sb, chunk_map = self.snapshots[seq]
        if chunk_map is None:
            return self._read_row_map(sb)
        return chunk_map_positions(chunk_map, self.header.num_rows, self.rpb,
                                   position_dtype(self.header.num_rows, self.rpb))

    def index_bytes(self) -> int:
        """Host memory the file's own index takes: the row map in log mode (chunk maps are negligible)."""
        return self.log.loc.nbytes if self.log is not None else 0

    def describe_snapshot(self, seq: int | None = None) -> dict:
        """A retained snapshot's metadata (`optimizer_step`, `time`, `row_map` of a log...) with its `seq` and
        the file's `path`.

        Args:
            seq: which snapshot: None (default) the newest committed one; else one of the two the file retains
                (`sorted(table.snapshots)`), e.g. the `storage.snapshot` of a checkpoint's descriptor.
        """
        if seq is None:
            seq = self.newest_seq
        if seq not in self.snapshots:
            raise KeyError(f"table file {str(self.path)!r} retains snapshots {sorted(self.snapshots)}, not {seq!r} "
                           "(a file keeps its last two commits)")
        sb = self.snapshots[seq][0]
        return dict(sb.meta, seq=seq, path=str(self.path))

    def __repr__(self) -> str:
        h = self.header
        state = "closed" if self.closed else "open for writing" if self.writable else "open read-only"
        return (f"<TableFile {str(self.path)!r}: {h.num_rows} rows x {h.dim} {h.dtype}, optimizer "
                f"{_optimizer_words(h)}, {'log' if self.is_log_file() else 'in place'}, snapshots "
                f"{sorted(self.snapshots)} (newest {self.newest_seq}), {state}>")

    def _rebuild_free(self) -> None:
        """Blocks in use: the retained snapshots' records and maps, and the live table's (no I/O in flight)."""
        highs = [sb.high_water for sb, _ in self.snapshots.values()]
        if self.log is not None:
            high = max(highs + [self.log.live.size])
            used = self.log.in_use(high)
        else:
            high = max(highs + [int(self.live.max()) + 1])
            used = np.zeros(high, dtype=bool)
            used[self.live] = True
        pinned, maps = np.zeros(high, dtype=bool), np.zeros(high, dtype=bool)
        for seq, (sb, _) in self.snapshots.items():
            pinned[self.pins[seq]] = True
            first = (sb.map_offset - DATA_OFFSET) // self.block
            maps[first: first + -(-sb.map_bytes // self.block)] = True
        pinned |= maps
        used |= pinned
        self.used = used
        self.free = np.flatnonzero(~used)[::-1].tolist()  # a stack: the lowest free block on top
        self._reads = []
        if self.log is not None:
            self.log.pinned, self.log.maps = pinned, maps
            self.log.quarantine.clear()
            self.log.held_out.clear()
            self.log.grow(high)

    def _alloc(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block = self.used.size
            self.used = np.concatenate([self.used, np.zeros(max(16, self.used.size // 8), dtype=bool)])
            self.free = list(range(self.used.size - 1, block, -1))
        self.used[block] = True
        return block

    def _alloc_run(self, n: int) -> int:
        """n contiguous free blocks (for a chunk map), at the end of the file when no free run is long enough."""
        free = np.flatnonzero(~self.used)
        if free.size >= n:
            starts = np.flatnonzero(np.diff(np.concatenate([[-2], free])) != 1)
            lengths = np.diff(np.concatenate([starts, [free.size]]))
            ok = np.flatnonzero(lengths >= n)
            if ok.size:
                first = int(free[starts[ok[0]]])
                self.used[first: first + n] = True
                self.free = np.flatnonzero(~self.used)[::-1].tolist()
                return first
        first = self.used.size
        self.used = np.concatenate([self.used, np.ones(n, dtype=bool)])
        return first

    def commit(self, meta: dict) -> int:
        """Make the live table a durable snapshot (see the module docstring); returns its seq."""
        self._check_writable()
        self.drain()
        try:
            with self._io("commit"):
                os.fdatasync(self.fd)
                return self._commit_map(meta)
        except TableIOError as error:
            error.reported = True
            raise

    def _commit_map(self, meta: dict) -> int:
        seq = max(self.snapshots, default=0) + 1
        if self.log is not None:
            data = self.log.map_bytes()
            meta = dict(meta, row_map=str(self.log.loc.dtype))
        else:
            data = memoryview(self.live.astype(np.int64)).cast("B")
        map_bytes = data.nbytes
        first = self._alloc_run(-(-map_bytes // self.block))
        map_offset = DATA_OFFSET + first * self.block
        self._pwrite_all(data, map_offset)
        high = self.used.size
        os.ftruncate(self.fd, max(os.fstat(self.fd).st_size, DATA_OFFSET + high * self.block))
        os.fdatasync(self.fd)
        sb = Superblock(seq, map_offset, map_bytes, high, dict(meta, time=time.time()))
        # The slot of the older retained snapshot (or an empty one) is overwritten; the newest stays.
        taken = set(self.slot_of.values())
        if len(taken) < 2:
            slot = min({0, 1} - taken)
        else:
            slot = self.slot_of[min(self.snapshots)]
        os.pwrite(self.fd, sb.encode(), SUPER_OFFSETS[slot])
        os.fdatasync(self.fd)
        for old in [s for s, sl in self.slot_of.items() if sl == slot]:
            del self.snapshots[old], self.slot_of[old], self.pins[old]
        if self.log is not None:
            self.log.commits += 1
            self.snapshots[seq] = (sb, None)
            self.pins[seq] = np.flatnonzero(self.log.live > 0)
        else:
            self.snapshots[seq] = (sb, self.live.copy())
            self.pins[seq] = self.snapshots[seq][1]
        self.slot_of[seq] = slot
        self._rebuild_free()
        self.stats["commits"] += 1
        return seq

    def rollback(self, seq: int) -> None:
        """Make snapshot `seq` (a retained one) the live table; rows written since it are dropped."""
        self._check_writable()
        if seq not in self.snapshots:
            raise TableMismatchError(
                f"table file {str(self.path)!r} does not retain snapshot {seq}: it keeps the last two commits "
                f"({sorted(self.snapshots)}); a checkpoint older than those was overwritten by later commits")
        self.drain()
        with self._map_lock:
            if self.log is not None:
                self.log.reset(self._snapshot_positions(seq))
            else:
                self.live = self.snapshots[seq][1].copy()
        self._rebuild_free()

    # ----------------------------------------------------------------- rows
    def row_offsets(self, ids: np.ndarray) -> np.ndarray:
        with self._map_lock:
            if self.log is not None:
                return self.log.offsets(ids)
            blocks = self.live[ids // self.rpb]
        return DATA_OFFSET + blocks * self.block + (ids % self.rpb) * self.record

    def read(self, ids: np.ndarray, sink=None, here: bool = False) -> IoTicket:
        """Read the records of rows `ids` (distinct) on the pool; `wait()` gives (records [k, record] uint8 in
        file order, order) with records[i] the row ids[order[i]]. `sink(records[a:b], order[a:b])`, when given,
        runs on the worker thread as each part lands. `here`: the caller waits for the rows at once, so its
        thread reads a share too instead of idling. Parts: see the module docstring."""
        self._check_usable()  # after a failed write the live table is lost: no row of it is served
        ids = np.asarray(ids, dtype=np.int64)
        ticket = IoTicket(None)
        if self.log is not None:  # registered before its offsets are taken: their blocks stay until it lands
            with self._alloc_lock:
                self._reads.append(ticket)
        records = torch.empty(ids.size, self.record, dtype=torch.uint8)
        buf = records.numpy()
        cold = self.disk_share is None or self.disk_share > COLD_SHARE
        self.stats["rows_read"] += int(ids.size)
        self.stats["bytes_read"] += int(ids.size) * self.record
        if not here and not cold:  # one part: a reader takes the offsets and their sort off the caller's thread
            order_t = torch.empty(ids.size, dtype=torch.int64)
            ticket.futures = [_submit(self._readers, self._read_whole, ids, buf, records, order_t, sink)]
            ticket._result = (records, order_t)
            self._pending.append(ticket)
            return ticket
        offsets, order, spans = self._sorted_spans(ids)
        parts = min((self._readers._max_workers if cold else 1) + int(here), max(1, spans.size - 1))
        cuts = np.linspace(0, spans.size - 1, parts + 1).astype(np.int64)
        order_t = torch.from_numpy(order)
        args = [(buf, offsets, spans[cuts[i]: cuts[i + 1] + 1], records, order_t, sink)
                for i in range(parts) if cuts[i + 1] > cuts[i]]
        mine = args.pop() if here and args else None  # the last part: the pool starts on the others first
        futures = [_submit(self._readers, self._read_part, *a) for a in args]
        if mine is not None:
            futures.append(_run_here(self._read_part, *mine))
        self._count_reads(offsets, spans)
        ticket.futures, ticket._result = futures, (records, order_t)
        self._pending.append(ticket)
        return ticket

    def _count_reads(self, offsets: np.ndarray, spans: np.ndarray) -> None:
        with self._stats_lock:
            self.stats["read_calls"] += int(spans.size - 1)
            self.stats["gap_bytes_read"] += rowio.gap_bytes(offsets, spans, self.record)

    def _sorted_spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets in file order, the order that sorts them, starts of runs of adjacent records)."""
        offsets = self.row_offsets(ids)
        order = np.argsort(offsets)  # distinct rows, distinct offsets: no stable sort needed (5x its speed)
        offsets = offsets[order]
        return offsets, order, rowio.spans(offsets, self.record, rowio.READ_GAP)

    def _read_whole(self, ids: np.ndarray, buf: np.ndarray, records, order_t, sink) -> None:
        with self._io("read"):
            offsets, order, spans = self._sorted_spans(ids)
            order_t.copy_(torch.from_numpy(order))
            self._count_reads(offsets, spans)
            self._read_part(buf, offsets, spans, records, order_t, sink)

    def _read_part(self, buf: np.ndarray, offsets: np.ndarray, spans: np.ndarray, records, order, sink) -> None:
        with self._io("read"):
            before = _blocks_read()
            short = rowio.pread_spans(self.fd, offsets, spans, self.record, buf)
            n = int(spans[-1] - spans[0])
            if before is not None and n:  # a racy update from several readers only mixes in one sample or another
                share = min(1.0, (_blocks_read() - before) * _BLOCK_IN / PAGE / n)
                self.disk_share = share if self.disk_share is None else 0.75 * self.disk_share + 0.25 * share
            if short:
                at = int(offsets[spans[short - 1]])
                raise CorruptTableError(f"table file {str(self.path)!r}: the file ends inside the record at offset "
                                        f"{at} (truncated while open?)")
            if sink is not None:
                a, b = int(spans[0]), int(spans[-1])
                sink(records[a:b], order[a:b])

    def write(self, ids: np.ndarray, records: torch.Tensor | DeferredRecords) -> IoTicket:
        """Write records [k, record] of rows `ids` (distinct, ascending) on the writer thread, after earlier
        writes; `records` must not change until the ticket is done (DeferredRecords: made on the writer, unless
        someone needed them first)."""
        self._check_writable()
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size > 1 and not (np.diff(ids) > 0).all():
            raise ValueError("table rows are written in ascending id order")
        n = len(self._writers)
        if n == 1:
            futures = [_submit(self._writers[0], self._write_task, ids, records, None, 0)]
        else:
            owner = (ids // self.rpb) % n
            futures = []
            for k in range(n):
                sel = np.flatnonzero(owner == k)
                if sel.size:
                    futures.append(_submit(self._writers[k], self._write_task, ids[sel], records,
                                           torch.from_numpy(sel), k))
        self.stats["rows_written"] += int(ids.size)
        self.stats["bytes_written"] += int(ids.size) * self.record
        ticket = IoTicket(futures)
        self._pending.append(ticket)
        return ticket

    def _write_task(self, ids: np.ndarray, records: torch.Tensor, sel: torch.Tensor | None, writer: int) -> None:
        """Write rows `ids` (records[sel], or all of `records`): chunks this writer owns. In log mode they are
        appended at the writer's head, then some dead records cleaned."""
        self._check_usable()  # an earlier write failed: the live table is lost, nothing is written on top
        if isinstance(records, DeferredRecords):
            records = records.get()
        if sel is not None:
            records = records.index_select(0, sel)
        if self.log is not None:
            with self._io("write-back"):
                self.log.append(writer, ids, records.numpy())
            with self._io("cleaning"):
                self.log.clean(writer, ids.size)
            with self._stats_lock:
                self.stats["write_calls"] += -(-ids.size // self.rpb)
            return
        with self._io("write-back"):
            self._write_in_place(ids, records)

    def _write_in_place(self, ids: np.ndarray, records: torch.Tensor) -> None:
        """`_write_task` in place: chunks a retained snapshot names copied first, then the records written."""
        chunks = np.unique(ids // self.rpb)
        shared = np.zeros(chunks.size, dtype=bool)
        live = self.live[chunks]
        for _, chunk_map in self.snapshots.values():
            shared |= chunk_map[chunks] == live
        for c, old in zip(chunks[shared].tolist(), live[shared].tolist()):
            new = self._reserve_block()
            self._copy_block(old, new)
            with self._map_lock:
                self.live[c] = new
        # Ascending ids: a run of adjacent records (one chunk, consecutive ids) is contiguous in `records` too.
        offsets = self.row_offsets(ids)
        spans = rowio.spans(offsets, self.record)
        rowio.pwrite_spans(self.fd, offsets, spans, self.record, records.numpy())
        with self._stats_lock:
            self.stats["write_calls"] += int(spans.size - 1)

    def _reserve_block(self) -> int:
        """A free block for a copy-on-write, the file grown to hold it (one writer at a time: growing by
        `ftruncate` must never shrink a block another writer just reserved)."""
        with self._alloc_lock:
            return self._reserve_block_locked()

    def _reserve_block_locked(self) -> int:
        block = self._alloc()
        need = DATA_OFFSET + (block + 1) * self.block
        if os.fstat(self.fd).st_size < need:
            os.ftruncate(self.fd, need)
        return block

    def reserve_log_block(self, writer: int) -> list[int]:
        """A free block made `writer`'s log head, [block, next slot] (blocks emptied while reads were in flight
        only once those landed)."""
        with self._map_lock, self._alloc_lock:
            log = self.log
            if log.quarantine:
                keep = []
                for entry in log.quarantine:
                    blocks, reads, move = entry
                    if all(r.done() for r in reads) and log.moves_done >= move:
                        self.free.extend(blocks)
                        self.used[blocks] = False
                        log.held_out.difference_update(blocks)
                    else:
                        keep.append(entry)
                log.quarantine = keep
            block = self._reserve_block_locked()
            log.grow(self.used.size)
            head = log.heads[writer] = [block, 0]
            return head

    def release_blocks(self, blocks: list[int]) -> None:
        """Blocks whose records all died: free once the reads now in flight, and a cleaning move under way
        (which may have read a record of them), are done."""
        with self._alloc_lock:
            log = self.log
            blocks = [b for b in blocks if b not in log.held_out and self.used[b]]
            if not blocks:
                return
            log.held_out.update(blocks)
            self._reads = [r for r in self._reads if not r.done()]
            log.quarantine.append((blocks, list(self._reads), log.moving))

    def write_records(self, buf: np.ndarray, offset: int) -> None:
        rowio.pwrite_paged(self.fd, buf, offset)

    def read_positions(self, pos: np.ndarray) -> np.ndarray:
        """Records at ascending positions (log mode's cleaning), read here: [n, record] uint8."""
        offsets = self.log.position_offsets(pos)
        buf = np.empty((pos.size, self.record), dtype=np.uint8)
        spans = rowio.spans(offsets, self.record, rowio.READ_GAP)
        if rowio.pread_spans(self.fd, offsets, spans, self.record, buf):
            raise CorruptTableError(f"table file {str(self.path)!r}: the file ends inside a record being "
                                    "moved (truncated while open?)")
        self._count_reads(offsets, spans)
        return buf

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of one block, in page-sized writes (see the module docstring)."""
        a, b = DATA_OFFSET + src * self.block, DATA_OFFSET + dst * self.block
        if not rowio.copy_paged(self.fd, a, b, self.block):
            raise CorruptTableError(f"table file {str(self.path)!r}: the file ends inside block {src} "
                                    "(truncated while open?)")
        with self._stats_lock:
            self.stats["blocks_copied"] += 1

    def _pwrite_all(self, data, offset: int) -> None:
        rowio.pwrite_paged(self.fd, data, offset)

    def drain(self) -> None:
        """Wait for every read and write issued so far (raising the first I/O error)."""
        pending, self._pending = self._pending, []
        for ticket in pending:
            ticket.wait()

    def prune(self) -> None:
        """Forget tickets that are done (called per batch)."""
        if len(self._pending) > 16:
            done = [t for t in self._pending if t.done()]
            for t in done:
                t.wait()
            self._pending = [t for t in self._pending if not t.done()]

    # ----------------------------------------------------------------- writer record and closing
    def _write_writer_record(self, is_open: bool) -> None:
        if is_open:
            self.token = secrets.randbits(63)
        rec = WriterRecord(is_open, os.getpid(), self.token, time.time(), socket.gethostname())
        os.pwrite(self.fd, rec.encode(), WRITER_OFFSET)

    def _check_writable(self) -> None:
        if self.closed:
            raise ValueError(f"table file {str(self.path)!r} is closed")
        if not self.writable:
            raise ValueError(f"table file {str(self.path)!r} is open read-only")
        self._check_usable()

    def close(self, meta: dict | None = None) -> None:
        """Commit (when `meta` is given), mark the file closed by its writer, release it. The file and its lock
        are released even when that fails (or failed before: then nothing is written, and the next opening
        needs recover=True)."""
        if self.closed:
            return
        try:
            if self.writable and self.failure is None:
                if meta is not None:
                    self.commit(meta)
                self.drain()
                with self._io("close"):
                    self._write_writer_record(False)
                    os.fsync(self.fd)
        finally:
            self.release()

    def release(self) -> None:
        """Let go of the file and its lock without writing anything (I/O threads stopped first)."""
        if self.closed:
            return
        self._shutdown()
        os.close(self.fd)
        self.closed = True

    def _shutdown(self) -> None:
        self._readers.shutdown(wait=True)
        for writer in self._writers:
            writer.shutdown(wait=True)

    def drop_page_cache(self) -> None:
        """Evict this file's pages from the OS page cache (benchmarks: cold reads). Dirty pages are synced."""
        self.drain()
        if self.writable:
            os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def file_bytes(self) -> int:
        return os.fstat(self.fd).st_size


def open_table(path, recover: bool = False, io_threads: int = 4) -> TableFile:
    """Open a table file read-only at its newest snapshot, for export or inspection: its rows with
    `iter_table_rows(table)`, a snapshot's metadata with `table.describe_snapshot()`, shape and optimizer in
    `table.header` (and its repr). Nothing is written; `table.close()` releases it.

    Args:
        path: the `.cemb` file (a `FileStorage` path, or a rank's `<stem>.rank<r>of<w>.cemb`).
        recover: open a file whose last writer died (not closed, lock free) at its last committed snapshot;
            without it such a file raises TableWriterDiedError naming the writer and that snapshot.
        io_threads: reader threads for `iter_table_rows`.
    """
    return TableFile.open(path, writable=False, recover=recover, io_threads=io_threads)


def iter_table_rows(table: TableFile, chunk_rows: int = 1 << 16):
    """(start, weight, {state: rows}, counts) for consecutive row ranges of the table, in id order: O(chunk)
    memory, for export by streaming."""
    layout = table.layout
    for start in range(0, table.header.num_rows, chunk_rows):
        stop = min(table.header.num_rows, start + chunk_rows)
        records, order = table.read(np.arange(start, stop, dtype=np.int64)).wait()
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        records = records.index_select(0, back)  # id order
        states = {name: layout.state_view(records, name) for name, _, _ in layout.state_cols}
        yield start, layout.weight_view(records), states, layout.count_view(records)


def default_writers(io_threads: int) -> int:
    """Writer threads: one per four cores this process may run on, at most io_threads // 2, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(io_threads // 2, cores // 4))


def _submit(pool: ThreadPoolExecutor, fn, *args) -> Future:
    """fn on the pool, or here and now once the pool is shut down (at interpreter exit, when the module's
    close runs after concurrent.futures stopped its workers)."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        return _run_here(fn, *args)


def _run_here(fn, *args) -> Future:
    """fn run on this thread now, as a done Future (its error raised by whoever waits, as a pool's would be)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits, as the pool would
        future.set_exception(exc)
    return future


def _check_expected(path: Path, header: TableHeader, expect: TableHeader) -> None:
    got = (header.num_rows, header.dim, header.dtype, header.state_cols)
    want = (expect.num_rows, expect.dim, expect.dtype, expect.state_cols)
    if got[:3] != want[:3]:
        raise TableMismatchError(f"table file {str(path)!r} holds a table of {header.num_rows} x {header.dim} "
                                 f"{header.dtype}, not the {expect.num_rows} x {expect.dim} {expect.dtype} "
                                 "asked for (another table's file?)")
    if tuple((n, c) for n, c, _ in got[3]) != tuple((n, c) for n, c, _ in want[3]):
        raise TableMismatchError(f"table file {str(path)!r} was written by {_optimizer_words(header)}; this "
                                 f"module uses {_optimizer_words(expect)}. A file keeps the optimizer state it "
                                 "was created with: train it with its own optimizer, or copy its rows "
                                 "(cachedemb.open_table + iter_table_rows) into a new file for this one")
    if header.shard != expect.shard:
        raise TableMismatchError(f"table file {str(path)!r} holds {header.describe_shard()}, not the "
                                 f"{expect.describe_shard()} asked for (another rank's file, or a job of another "
                                 "world size or plan: a table on file is not resharded)")


def _optimizer_words(header: TableHeader) -> str:
    """'Adagrad (per-row state: sum, 8 columns)', 'SGD (no per-row state)', 'no optimizer (no per-row state)'."""
    name = (header.optimizer or "").split("(")[0].strip() or "no optimizer"
    if not header.state_cols:
        return f"{name} (no per-row state)"
    states = ", ".join(f"{n}, {c} column{'s' if c != 1 else ''}" for n, c, _ in header.state_cols)
    return f"{name} (per-row state: {states})"


def _blocks_read() -> int | None:
    """512-byte blocks this thread has read from the storage layer (None where the platform does not say)."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_inblock
    except (AttributeError, OSError):
        return None


def _advise_random(fd: int) -> None:
    """Rows are read at random: no read-ahead of neighbouring pages."""
    with _suppress():
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def _suppress():
    return contextlib.suppress(OSError)

