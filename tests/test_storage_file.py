"""The table file (cachedemb.storage.table_file): rows round-trip through batched reads and writes, a committed
snapshot is never written (copy-on-write) and the file keeps the last two, and bad files (truncated, foreign,
another table's, a dead writer's, one in use) are refused with an error naming the file, overwriting nothing."""
from __future__ import annotations

import ctypes
import os
import struct
import time
import uuid

import numpy as np
import pytest
import torch

from cachedemb.storage.format import (
    SUPER_OFFSETS,
    CorruptTableError,
    TableHeader,
    TableLockedError,
    TableMismatchError,
    TableWriterDiedError,
)
from cachedemb.storage.table_file import TableFile, iter_table_rows, open_table

N, D = 1000, 5


pytestmark = [pytest.mark.usefixtures("io_loop")]  # the span loop in C and in Python


def header(num_rows=N, dim=D, state=(("sum", 1, 0.5),), rows_per_block=64):
    return TableHeader(num_rows, dim, torch.float32, state, "RowWiseAdagrad()", rows_per_block, uuid.uuid4().hex,
                       "weight", time.time())


def rows_of(seed=0, num_rows=N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, D, generator=g), torch.rand(num_rows, 1, generator=g), torch.arange(num_rows)


def create(path, h=None, seed=0):
    h = h or header()
    w, s, c = rows_of(seed, h.num_rows)
    return TableFile.create(path, h, lambda a, b: (w[a:b], {"sum": s[a:b]}, c[a:b]))


def read(table, ids):
    records, order = table.read(np.asarray(ids)).wait()
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    records = records.index_select(0, back)
    lay = table.layout
    return lay.weight_view(records), lay.state_view(records, "sum"), lay.count_view(records)


def write(table, ids, value):
    k = len(ids)
    table.write(np.asarray(ids), table.layout.pack(torch.full((k, D), float(value)), {"sum": torch.full((k, 1), 1.0)},
                                                   torch.full((k,), 7))).wait()


def table_rows(table):
    return torch.cat([w for _, w, _, _ in iter_table_rows(table, chunk_rows=300)])


def test_rows_round_trip_in_any_order(tmp_path):
    t = create(tmp_path / "t.cemb")
    w, s, c = rows_of(0)
    ids = np.array([999, 0, 63, 64, 65, 500, 1, 2, 3])  # block edges, adjacent runs, out of order
    got_w, got_s, got_c = read(t, ids)
    idx = torch.from_numpy(ids)
    assert torch.equal(got_w, w[idx]) and torch.equal(got_s, s[idx]) and torch.equal(got_c, c[idx])
    write(t, [5, 6, 700], 3.5)
    got_w, _, got_c = read(t, [5, 6, 7, 700])
    assert torch.equal(got_w[:, 0], torch.tensor([3.5, 3.5, w[7, 0], 3.5]))
    assert got_c.tolist() == [7, 7, int(c[7]), 7]
    assert torch.equal(table_rows(t)[[5, 6, 700]], torch.full((3, D), 3.5))
    t.close()


def far_apart(t):
    """Rows whose records are too far apart to share a read (rowio.READ_GAP): a span each, enough for every part."""
    from cachedemb.storage import rowio

    ids = np.arange(0, N, 2 + (rowio.READ_GAP + t.record) // t.record)
    assert ids.size > 2 * t._readers._max_workers
    return ids


def test_a_read_waited_for_at_once_takes_a_share_on_the_calling_thread(tmp_path):
    """`here=True` (the forward waits for its misses): the caller reads the last part itself; the records are
    the same as the pool's alone, and its error (a truncated file) is raised at wait(), as a worker's is."""
    import threading

    t = create(tmp_path / "t.cemb")
    ids = far_apart(t)
    threads = []
    ticket = t.read(ids, sink=lambda records, order: threads.append(threading.get_ident()), here=True)
    mine, _ = ticket.wait()
    assert threading.get_ident() in threads and len(threads) >= 2
    pool, _ = t.read(ids).wait()
    assert torch.equal(mine, pool)
    w, s, c = rows_of(0)
    got_w, got_s, got_c = read(t, ids)
    assert torch.equal(got_w, w[ids]) and torch.equal(got_c, c[ids])
    os.truncate(t.path, os.path.getsize(t.path) // 2)
    ticket = t.read(np.array([0, N - 1]), here=True)  # the part read here meets the end of the file
    with pytest.raises(CorruptTableError, match="truncated"):
        ticket.wait()
    t._pending.clear()
    t.close()


def test_committed_snapshot_is_never_overwritten(tmp_path):
    t = create(tmp_path / "t.cemb")
    before = table_rows(t).clone()
    write(t, [10, 11], 1.0)
    s2 = t.commit({"optimizer_step": 2})
    copied = t.stats["blocks_copied"]
    assert copied >= 1  # the first write after the creation's snapshot copied its block
    write(t, [10, 900], 2.0)  # after s2: block of 10 copied again, 900's too
    assert t.stats["blocks_copied"] == copied + 2
    write(t, [11], 3.0)  # same chunk as 10, already private since s2: written in place
    assert t.stats["blocks_copied"] == copied + 2
    t.rollback(s2)
    rows = table_rows(t)
    assert torch.equal(rows[[10, 11]], torch.full((2, D), 1.0)) and torch.equal(rows[900], before[900])
    t.rollback(1)  # the creation's snapshot is still retained (the last two are)
    assert torch.equal(table_rows(t), before)
    t.commit({})
    t.commit({})
    with pytest.raises(TableMismatchError, match="does not retain snapshot 1"):
        t.rollback(1)
    t.close()


def _pages_in_large_folios(path) -> tuple[int, int]:
    """(pages of `path` in the page cache, of which in large folios): mincore over a read-only mapping, then
    each cached page's frame in /proc/self/pagemap and its compound-page flags in /proc/kpageflags (root only).
    Only pages already cached are touched, so looking creates no folio."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    try:
        vec = np.zeros(-(-size // page), dtype=np.uint8)
        assert libc.mincore(addr, size, vec.ctypes.data) == 0
        cached = np.flatnonzero(vec & 1)
        large = 0
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap, \
                open("/proc/kpageflags", "rb", buffering=0) as kflags:  # unbuffered: the entries change
            for p in cached.tolist():
                ctypes.c_char.from_address(addr + p * page).value  # map the cached page
                pagemap.seek((addr // page + p) * 8)
                entry = struct.unpack("Q", pagemap.read(8))[0]
                assert entry >> 63, "a cached page that was just touched is not present"
                kflags.seek((entry & ((1 << 55) - 1)) * 8)
                large += bool(struct.unpack("Q", kflags.read(8))[0] & (3 << 15))  # COMPOUND_HEAD / _TAIL
        return int(cached.size), large
    finally:
        libc.munmap(addr, size)
        os.close(fd)


def test_page_cache_keeps_the_table_in_small_folios(tmp_path):
    """Creation, copy-on-write and long runs of rows write in page pieces, so a record rewritten later lands in a
    4 KiB folio (rowio.c: ~5x cheaper than in a large one). Checked where this file system makes large folios
    (a control file written in one call must have them) and /proc/kpageflags can be read."""
    if not os.access("/proc/kpageflags", os.R_OK):
        pytest.skip("/proc/kpageflags needs root")
    control = tmp_path / "control.bin"
    with open(control, "wb") as f:
        f.write(os.urandom(4 << 20))
    if _pages_in_large_folios(control)[1] == 0:
        pytest.skip("this file system keeps 4 KiB page-cache folios (no large folios to avoid)")
    path = tmp_path / "t.cemb"
    h = header(num_rows=20000, rows_per_block=2000)  # 36 B records: 72 KB blocks, 720 KB of rows
    t = create(path, h)
    cached, large = _pages_in_large_folios(path)
    assert cached > 100 and large == 0, (cached, large)
    k = 3000  # a long run of adjacent rows across blocks (copied on write first: the creation was committed)
    t.write(np.arange(5000, 5000 + k), t.layout.pack(torch.ones(k, D), {"sum": torch.ones(k, 1)},
                                                        torch.ones(k, dtype=torch.int64))).wait()
    assert t.stats["blocks_copied"] >= 2
    cached, large = _pages_in_large_folios(path)
    assert large == 0, (cached, large)
    assert torch.equal(read(t, [5000, 7999])[0], torch.ones(2, D))
    t.close()


def test_file_size_stays_bounded_over_many_commits(tmp_path):
    t = create(tmp_path / "t.cemb")
    rng = np.random.default_rng(0)
    sizes = []
    for step in range(12):
        write(t, np.unique(rng.integers(0, N, 200)), step)
        t.commit({"step": step})
        sizes.append(t.file_bytes())
    # at most three versions of each block (two retained snapshots + live) and their maps: no growth per commit
    assert sizes[-1] == sizes[4], sizes
    t.close()


def test_writes_on_several_writers_land_in_submission_order(tmp_path):
    """Writes queued without waiting, on four writers, overlapping rows from batch to batch and
    copying blocks on write after a commit: the file ends with each row's last write, and the committed
    snapshot keeps what it had."""
    h = header()
    w, s, c = rows_of(0, h.num_rows)
    t = TableFile.create(tmp_path / "t.cemb", h, lambda a, b: (w[a:b], {"sum": s[a:b]}, c[a:b]), write_threads=4)
    assert len(t._writers) == 4
    rng = np.random.default_rng(1)
    expect = w.clone()
    snapshot = None
    for step in range(40):
        ids = np.unique(rng.integers(0, N, 300))
        values = torch.from_numpy(rng.standard_normal((ids.size, D)).astype(np.float32))
        t.write(ids, t.layout.pack(values, {"sum": torch.ones(ids.size, 1)}, torch.full((ids.size,), step)))
        expect[torch.from_numpy(ids)] = values
        if step == 19:
            seq = t.commit({"step": step})
            snapshot = expect.clone()
    t.drain()
    assert torch.equal(table_rows(t), expect)
    t.rollback(seq)
    assert torch.equal(table_rows(t), snapshot)
    t.close()


def test_writer_threads_follow_the_cores(monkeypatch):
    from cachedemb.storage import table_file
    monkeypatch.setattr(table_file.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert table_file.default_writers(4) == 1  # a 2-core box: one writer (more only take turns with training)
    monkeypatch.setattr(table_file.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert table_file.default_writers(4) == 2 and table_file.default_writers(16) == 4


def test_reads_are_split_over_the_readers_only_while_records_come_from_the_disk(tmp_path):
    """Parallel parts keep requests in flight on a disk; from a warm page cache they only take CPU turns, so a
    read goes in one part there (plus the caller's share with `here`). The records are the same either way."""
    import threading

    from cachedemb.storage.table_file import COLD_SHARE

    t = create(tmp_path / "t.cemb")
    ids = far_apart(t)
    me = threading.get_ident()

    def parts(disk_share, here):
        t.disk_share = disk_share
        threads = []
        records, _ = t.read(ids, sink=lambda r, o: threads.append(threading.get_ident()), here=here).wait()
        return len(threads), threads.count(me), records

    readers = t._readers._max_workers
    assert readers == 4
    n, mine, warm = parts(COLD_SHARE / 10, here=False)
    assert (n, mine) == (1, 0)
    n, mine, warm_here = parts(COLD_SHARE / 10, here=True)
    assert (n, mine) == (2, 1)
    n, mine, cold = parts(min(1.0, COLD_SHARE * 3), here=False)
    assert (n, mine) == (readers, 0)
    n, mine, cold_here = parts(None, here=True)  # nothing measured yet: as from the disk
    assert (n, mine) == (readers + 1, 1)
    assert torch.equal(warm, cold) and torch.equal(warm, warm_here) and torch.equal(warm, cold_here)
    t.close()


def test_reads_measure_the_share_that_came_from_the_disk(tmp_path):
    """The readers' own block input says where records came from: none from the disk right after writing them
    (page cache), most once the file's pages are dropped (a cold read splits over the readers again)."""
    from cachedemb.storage.table_file import COLD_SHARE

    if not hasattr(__import__("resource"), "RUSAGE_THREAD"):
        pytest.skip("no per-thread rusage here: reads always split")
    t = create(tmp_path / "t.cemb", header(num_rows=20000, rows_per_block=2000))
    ids = np.arange(0, 20000, 120)  # 167 records, each in a page of its own
    t.disk_share = None
    t.read(ids).wait()
    assert t.disk_share is not None and t.disk_share < COLD_SHARE  # just written: in the page cache
    t.drop_page_cache()
    if t.disk_share is not None:
        t.disk_share = 0.0
    t.read(ids).wait()
    if t.disk_share == 0.0:
        pytest.skip("the file's pages stayed cached after POSIX_FADV_DONTNEED (nothing read from the disk)")
    assert t.disk_share >= 0.2  # every record from the disk: a sample of ~1.0 mixed into 0.0 with weight 1/4
    t.close()


def test_reopen_continues_from_the_newest_snapshot(tmp_path):
    path = tmp_path / "t.cemb"
    t = create(path)
    write(t, [3], 9.0)
    t.close({"optimizer_step": 5})
    t = TableFile.open(path, writable=True)
    assert t.snapshots[t.newest_seq][0].meta["optimizer_step"] == 5
    assert torch.equal(read(t, [3])[0], torch.full((1, D), 9.0))
    t.close()


def test_writer_that_died_is_reported_with_its_last_snapshot(tmp_path):
    path = tmp_path / "t.cemb"
    t = create(path)
    write(t, [1], 4.0)
    seq = t.commit({"optimizer_step": 3})
    write(t, [2], 8.0)  # after the last commit: lost with the writer
    t._shutdown()
    os.close(t.fd)  # the process "dies": no close, writer record left open, lock released
    for writable in (True, False):
        with pytest.raises(TableWriterDiedError, match=f"{path}.*snapshot {seq}.*recover=True") as err:
            TableFile.open(path, writable=writable)
        assert err.value.snapshot["seq"] == seq and err.value.snapshot["optimizer_step"] == 3
    t = open_table(path, recover=True)
    w = read(t, [1, 2])[0]
    assert torch.equal(w[0], torch.full((D,), 4.0)) and torch.equal(w[1], rows_of(0)[0][2])
    t.close()
    t = TableFile.open(path, writable=True, recover=True)
    t.close({})
    TableFile.open(path, writable=True).close()  # closed cleanly now


def test_one_writer_at_a_time(tmp_path):
    path = tmp_path / "t.cemb"
    t = create(path)
    with pytest.raises(TableLockedError, match=f"{path}.*pid {os.getpid()}"):
        TableFile.open(path, writable=True)
    with pytest.raises(TableLockedError):
        open_table(path)
    t.close()


def test_bad_files_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "t.cemb"
    create(path).close()
    good = path.read_bytes()
    with pytest.raises(FileExistsError, match="never overwrites"):
        create(path)
    assert path.read_bytes() == good
    with pytest.raises(FileNotFoundError, match="nope.cemb"):
        open_table(tmp_path / "nope.cemb")
    with pytest.raises(TableMismatchError, match=f"{path}.*1000 x 5.*not the 1000 x 6"):
        TableFile.open(path, expect=header(dim=6))
    with pytest.raises(TableMismatchError, match="optimizer state"):
        TableFile.open(path, expect=header(state=(("exp_avg", 5, 0.0), ("exp_avg_sq", 5, 0.0))))
    cases = {
        "short.cemb": good[:100],
        "truncated.cemb": good[: len(good) - 4096 * 3],
        "foreign.cemb": b"PK\x03\x04" + good[4:],
        "header.cemb": good[:40] + bytes([good[40] ^ 0xFF]) + good[41:],
        "supers.cemb": good[: SUPER_OFFSETS[0]] + b"\0" * 8192 + good[SUPER_OFFSETS[0] + 8192:],
    }
    messages = {"short.cemb": "truncated", "truncated.cemb": "truncated", "foreign.cemb": "not a cachedemb table",
                "header.cemb": "checksum", "supers.cemb": "no valid superblock"}
    for name, data in cases.items():
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(CorruptTableError, match=f"{bad}.*{messages[name]}|{messages[name]}.*{bad}"):
            TableFile.open(bad, writable=True)
        assert bad.read_bytes() == data, name  # nothing written to a refused file


def test_torn_superblock_keeps_the_newest_snapshot(tmp_path):
    """A crash while a commit writes its superblock tears the slot of the *older* snapshot: the newest stands."""
    path = tmp_path / "t.cemb"
    t = create(path)
    write(t, [4], 6.0)
    newest = t.commit({"optimizer_step": 1})
    slot_of_older = t.slot_of[min(t.snapshots)]
    t.close()
    data = bytearray(path.read_bytes())
    off = SUPER_OFFSETS[slot_of_older]
    data[off + 20: off + 30] = b"\xAB" * 10  # half-written
    path.write_bytes(bytes(data))
    t = TableFile.open(path, writable=False)
    assert sorted(t.snapshots) == [newest]
    assert torch.equal(read(t, [4])[0], torch.full((1, D), 6.0))
    t.close()


def test_reads_span_records_a_small_gap_apart(tmp_path):
    """rowio: a read covers records at most READ_GAP bytes apart (one call, the gaps read into a scratch buffer),
    and gives each record's bytes exactly, as one pread a record does; spans grouped otherwise (adjacent only,
    or gaps wider than READ_GAP handed to the C loop) read the same; a span running past the end of the file
    is named by its index."""
    from cachedemb.storage import rowio

    rng = np.random.default_rng(3)
    rec, size = 24, 200_000
    data = rng.integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for trial in range(30):
            gaps = rng.choice([0, 1, 100, rowio.READ_GAP - 1, rowio.READ_GAP, rowio.READ_GAP + 1, 5000], 300)
            offsets = np.cumsum(gaps + rec) - rec
            offsets = offsets[offsets + rec <= size].astype(np.int64)
            want = np.stack([data[o: o + rec] for o in offsets]).reshape(-1)
            for starts in (rowio.spans(offsets, rec, rowio.READ_GAP),
                           np.flatnonzero(np.diff(offsets, prepend=-1 - rec) != rec).tolist() + [offsets.size],
                           [0, offsets.size]):
                starts = np.asarray(starts, dtype=np.int64)
                buf = np.zeros(offsets.size * rec, dtype=np.uint8)
                assert rowio.pread_spans(fd, offsets, starts, rec, buf) == 0
                assert np.array_equal(buf, want), trial
        spans = rowio.spans(offsets, rec, rowio.READ_GAP)
        assert spans.size - 1 < offsets.size  # records near each other share a call
        between = [int(offsets[j + 1] - offsets[j] - rec) for j in range(offsets.size - 1)]
        assert rowio.gap_bytes(offsets, spans, rec) == sum(g for g in between if g <= rowio.READ_GAP) > 0
        past = np.append(offsets, size - rec // 2).astype(np.int64)  # the last record crosses the end
        starts = rowio.spans(past, rec, rowio.READ_GAP)
        buf = np.zeros(past.size * rec, dtype=np.uint8)
        assert rowio.pread_spans(fd, past, starts, rec, buf) == starts.size - 1
    finally:
        os.close(fd)
