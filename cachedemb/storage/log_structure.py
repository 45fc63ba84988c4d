"""A table file written as a log: every write-back appends, a per-row location map says where each row is.

Written in place, each evicted row costs the kernel a dirtied page (~1.6 us a record on ext4, more than the
in-memory step's whole budget at a 1/16 host cache); appended, a batch of records is one sequential write
(~0.2 us a record, `scripts/bench_io_floor.py --log-writes`). So in log mode no record is ever rewritten where it
lies: a row's newest record is wherever its last write-back appended it, and `loc[row]` (a position
block * rows_per_block + slot, 4 bytes a row while the file has fewer than 2^31 record slots) finds it. The map
is counted in `host_cache_bytes` (the host cache gives up rows for it).

Blocks are the file's unit of space, as for the chunk maps: a block's records die as their rows are appended
elsewhere; a block with no live record that no retained snapshot names is free. Each writer thread appends into
a head block of its own. Dead records are reclaimed by cleaning (LFS): once the dead records in candidate blocks
exceed `slack` x the table's rows, the blocks with the fewest live records are chosen (one scan of the map finds
their rows) and their live records appended again, at most `clean_ratio` x the records appended since the last
move, so a step's write cost stays bounded. Candidates: blocks no retained snapshot pins until the file has
committed once since it was opened; from then on pinned blocks too (a commit pins every block holding a live
record, so a block kept by one long-lived record would otherwise never come back; a cleaned pinned block is free
two commits later). Without commits the file holds at most the opened snapshot's blocks, the rows moved since
and the slack. A move is committed only if the row was not written
meanwhile (another writer's append wins). A block emptied while reads are in flight is reused only after those
reads land (they may still read a record of it: a moved row's old copy).

A commit writes the whole map (4 bytes a row) into free blocks where the chunk map went; the superblock's
metadata says `row_map: <dtype>`. Snapshots pin the blocks holding a record their map names, so appends (into
free blocks, or the unwritten slots of a head block) never touch a retained snapshot.
"""
from __future__ import annotations

import threading

import numpy as np

CLEAN_QUEUE_ROWS = 1 << 18  # rows of chosen blocks held for moving at once (16 B each)
_SCAN = 1 << 20  # map entries per step of a scan (bounds its temporaries)


def position_dtype(num_rows: int, rows_per_block: int) -> np.dtype:
    """int32 positions while the file can grow to 4x the table's slots, else int64."""
    slots = 4 * (num_rows + 2 * rows_per_block)
    return np.dtype(np.int32) if slots < 2 ** 31 else np.dtype(np.int64)


def chunk_map_positions(chunk_map: np.ndarray, num_rows: int, rpb: int, dtype) -> np.ndarray:
    """The positions a chunk-map snapshot (format 1) gives each row."""
    loc = np.empty(num_rows, dtype=dtype)
    for a in range(0, num_rows, _SCAN):
        r = np.arange(a, min(num_rows, a + _SCAN), dtype=np.int64)
        loc[a: a + r.size] = chunk_map[r // rpb] * rpb + r % rpb
    return loc


def block_counts(loc: np.ndarray, rpb: int, blocks: int) -> np.ndarray:
    """Live records per block of a position map (scanned in pieces)."""
    counts = np.zeros(blocks, dtype=np.int64)
    for a in range(0, loc.size, _SCAN):
        part = np.bincount(loc[a: a + _SCAN] // rpb, minlength=blocks)
        if part.size > counts.size:
            counts = np.concatenate([counts, np.zeros(part.size - counts.size, dtype=np.int64)])
        counts[: part.size] += part
    return counts


class RowLog:
    """The live position map of a log-mode TableFile and its block accounting (see the module docstring).
    Locks: the table's `_map_lock` guards `loc` and `live`; its `_alloc_lock` the blocks' use."""

    def __init__(self, table, loc: np.ndarray, slack: float, clean_ratio: float = 2.0):
        self.table, self.rpb = table, table.rpb
        self.loc = loc
        self.slack, self.clean_ratio = float(slack), float(clean_ratio)
        self.live = block_counts(loc, self.rpb, table.used.size)
        self.pinned = np.zeros(0, dtype=bool)  # blocks a retained snapshot needs (records or map)
        self.maps = np.zeros(0, dtype=bool)  # of those, the snapshots' maps (never a cleaning candidate)
        self.heads: dict[int, list[int]] = {}  # writer -> [block, next slot]
        # Emptied blocks waiting to be free: (blocks, reads then in flight, the cleaning move then under way).
        self.quarantine: list[tuple[list[int], list, int]] = []
        self.held_out: set[int] = set()  # the blocks in quarantine
        self.moving, self.moves_done = 0, 0  # the cleaning move under way (0: none), the last one finished
        self.queue = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # (rows, their old positions) to move
        self._clean_lock, self._owed_lock = threading.Lock(), threading.Lock()
        self.owed = 0  # records appended since the last cleaning move
        self.commits = 0  # commits since the file was opened: pinned blocks are cleaned once there was one
        self.stats = dict.fromkeys(("rows_appended", "rows_cleaned", "blocks_cleaned", "clean_scans"), 0)

    # ----------------------------------------------------------------- positions
    def offsets(self, ids: np.ndarray) -> np.ndarray:
        return self.position_offsets(self.loc[ids].astype(np.int64))

    def position_offsets(self, pos: np.ndarray) -> np.ndarray:
        t = self.table
        return t.data_offset + (pos // self.rpb) * t.block + (pos % self.rpb) * t.record

    def map_bytes(self) -> memoryview:
        return memoryview(self.loc).cast("B")

    def reset(self, loc: np.ndarray) -> None:
        """A new live map (open, rollback): heads, moves and quarantine start over (no I/O is in flight)."""
        self.loc = loc
        self.live = block_counts(loc, self.rpb, self.table.used.size)
        self.heads.clear()
        self.quarantine.clear()
        self.held_out.clear()
        self.queue = (np.zeros(0, np.int64), np.zeros(0, np.int64))

    def in_use(self, blocks: int) -> np.ndarray:
        """Blocks [0, blocks) that hold a live record or are a head (for the table's free list)."""
        used = np.zeros(blocks, dtype=bool)
        n = min(blocks, self.live.size)
        used[:n] = self.live[:n] > 0
        for block, _ in self.heads.values():
            used[block] = True
        return used

    def grow(self, blocks: int) -> None:
        if self.live.size < blocks:
            self.live = np.concatenate([self.live, np.zeros(blocks - self.live.size, dtype=np.int64)])

    # ----------------------------------------------------------------- appending
    def append(self, writer: int, ids: np.ndarray, buf: np.ndarray, old: np.ndarray | None = None) -> int:
        """Append records buf [n, record] of rows `ids` at this writer's head; then point the rows at them (only
        those whose position is still `old`, when given: a cleaning move). Returns the rows moved."""
        t = self.table
        n = ids.size
        pos = np.empty(n, dtype=np.int64)
        i = 0
        while i < n:
            head = self.heads.get(writer)
            if head is None or head[1] == self.rpb:
                head = t.reserve_log_block(writer)
            block, slot = head
            take = min(self.rpb - slot, n - i)
            with t._map_lock:  # counted before they are written: a block being filled is never seen empty
                self.live[block] += take
            t.write_records(buf[i: i + take], t.data_offset + block * t.block + slot * t.record)
            pos[i: i + take] = block * self.rpb + slot + np.arange(take)
            head[1] += take
            i += take
        return self._point(ids, pos, old)

    def _point(self, ids: np.ndarray, pos: np.ndarray, old: np.ndarray | None) -> int:
        t = self.table
        with t._map_lock:
            if pos.size and pos.max() > np.iinfo(self.loc.dtype).max:
                self.loc = self.loc.astype(np.int64)
            if old is not None:
                keep = self.loc[ids] == old
                ids, pos, dead_new = ids[keep], pos[keep], pos[~keep]
            else:
                dead_new = pos[:0]
            before = self.loc[ids].astype(np.int64)
            self.loc[ids] = pos
            blocks = self.live.size
            self.live -= np.bincount(before // self.rpb, minlength=blocks)[:blocks]
            self.live -= np.bincount(dead_new // self.rpb, minlength=blocks)[:blocks]  # copies moved in vain
            touched = np.unique(np.concatenate([before // self.rpb, dead_new // self.rpb]))
            empty = touched[self.live[touched] == 0]
        self.stats["rows_appended"] += int(ids.size) if old is None else 0
        if empty.size:
            t.release_blocks([b for b in empty.tolist() if not self._held(b)])
        return int(ids.size)

    def _held(self, block: int) -> bool:
        heads = list(self.heads.values())  # one C-level copy: another writer may add its head meanwhile
        return (block < self.pinned.size and self.pinned[block]) or any(h[0] == block for h in heads)

    # ----------------------------------------------------------------- cleaning
    def clean(self, writer: int, appended: int) -> None:
        """Move up to clean_ratio x the records appended since the last move (on every writer) out of the
        emptiest blocks, when the dead records in unpinned blocks exceed the slack (one writer at a time; the
        others leave their appends owed)."""
        with self._owed_lock:
            self.owed += appended
        if not self._clean_lock.acquire(blocking=False):
            return
        try:
            with self._owed_lock:
                appended, self.owed = self.owed, 0
            rows, old = self.queue
            if rows.size == 0:
                rows, old = self._choose()
                if rows.size == 0:
                    return
            take = max(1, int(self.clean_ratio * max(appended, 1)))
            now_rows, now_old = rows[:take], old[:take]
            self.queue = (rows[take:], old[take:])
            with self.table._map_lock:
                still = self.loc[now_rows] == now_old
            now_rows, now_old = now_rows[still], now_old[still]
            if now_rows.size:
                self.moving = self.moves_done + 1
                try:
                    buf = self.table.read_positions(now_old)
                    self.stats["rows_cleaned"] += self.append(writer, now_rows, buf, now_old)
                finally:
                    self.moves_done, self.moving = self.moving, 0
        finally:
            self._clean_lock.release()

    def _choose(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows of the emptiest unpinned blocks, whose moves bring the dead records back under half the
        slack (at most CLEAN_QUEUE_ROWS of them), sorted by position. Blocks with no live record are freed."""
        t = self.table
        with t._map_lock, t._alloc_lock:
            blocks = min(self.live.size, t.used.size)
            live = self.live[:blocks]
            cand = t.used[:blocks].copy()
            pinned = np.zeros(blocks, dtype=bool)
            pinned[: min(blocks, self.pinned.size)] = self.pinned[:blocks]
            cand[: min(blocks, self.maps.size)] &= ~self.maps[:blocks]
            if not self.commits:  # pinned by the snapshot opened: cleaning them frees nothing until two commits
                cand &= ~pinned
            for block, _ in self.heads.values():
                if block < blocks:
                    cand[block] = False
            cand[[b for b in self.held_out if b < blocks]] = False
            idx = np.flatnonzero(cand)
            dead = self.rpb - live[idx]
            excess = int(dead.sum()) - int(self.slack * self.table.header.num_rows)
            if excess <= 0:
                return self.queue
            order = idx[np.argsort(live[idx], kind="stable")]
            gain = np.cumsum(self.rpb - live[order])
            cost = np.cumsum(live[order])
            n = int(np.searchsorted(gain, excess + int(self.slack * self.table.header.num_rows) // 2)) + 1
            n = max(1, min(n, int(np.searchsorted(cost, CLEAN_QUEUE_ROWS, side="right")), order.size))
            chosen = order[:n]
            zero = chosen[(live[chosen] == 0) & ~pinned[chosen]]  # pinned ones are free once their snapshots go
        if zero.size:
            t.release_blocks(zero.tolist())
        chosen = chosen[self.live[chosen] > 0]
        if chosen.size == 0:
            return self.queue
        mask = np.zeros(blocks, dtype=bool)
        mask[chosen] = True
        rows, old = [], []
        loc = self.loc
        for a in range(0, loc.size, _SCAN):
            part = loc[a: a + _SCAN].astype(np.int64)
            hit = np.flatnonzero(mask[np.minimum(part // self.rpb, blocks - 1)] & (part // self.rpb < blocks))
            rows.append(hit + a)
            old.append(part[hit])
        rows, old = np.concatenate(rows), np.concatenate(old)
        order = np.argsort(old, kind="stable")
        self.stats["blocks_cleaned"] += int(chosen.size)
        self.stats["clean_scans"] += 1
        return rows[order], old[order]
