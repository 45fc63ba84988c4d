"""A table file written as a log (cachedemb.storage.log_structure): every write appends, a row map finds each row's
newest record, cleaning moves live records out of the emptiest blocks. Checked against a brute-force copy of the
table kept in memory: rows read back after random writes on one and four writers with reads in flight, snapshots
never touched by later appends or cleaning (rollback, a writer that died), a file written in place turned into a
log, and a damaged row map refused naming the file."""
from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from cachedemb.storage.format import CorruptTableError, TableHeader
from cachedemb.storage.table_file import TableFile, iter_table_rows

N, D, RPB = 600, 4, 16


pytestmark = [pytest.mark.usefixtures("io_loop")]  # the span loop in C and in Python


def header():
    return TableHeader(N, D, torch.float32, (("sum", 1, 0.5),), "RowWiseAdagrad()", RPB, uuid.uuid4().hex,
                       "weight", time.time())


def create(path, log=True, slack=0.1, writers=None):
    w = torch.arange(N * D, dtype=torch.float32).view(N, D)
    return TableFile.create(path, header(), lambda a, b: (w[a:b], {"sum": torch.ones(b - a, 1)},
                                                          torch.zeros(b - a, dtype=torch.int64)),
                            log=log, log_slack=slack, write_threads=writers)


def write(table, ids, values, reference):
    ids = np.sort(np.asarray(ids, dtype=np.int64))
    rows = torch.from_numpy(values[ids].astype(np.float32))
    reference[ids] = values[ids]
    return table.write(ids, table.layout.pack(rows, {"sum": torch.ones(ids.size, 1)},
                                              torch.from_numpy(ids)))


def read(table, ids):
    records, order = table.read(np.asarray(ids, dtype=np.int64)).wait()
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    records = records.index_select(0, back)
    return table.layout.weight_view(records).numpy(), table.layout.count_view(records).numpy()


def all_rows(table):
    return torch.cat([w for _, w, _, _ in iter_table_rows(table, chunk_rows=250)]).numpy()


def initial():
    return np.arange(N * D, dtype=np.float32).reshape(N, D)


@pytest.mark.parametrize("writers", [1, 4])
def test_random_writes_read_back_through_appends_and_cleaning(tmp_path, writers):
    """Writes of random rows (Zipf-like: a hot few rewritten often) with reads in flight on other rows: every
    row reads back as last written; dead records are cleaned, blocks reused, the file stays bounded."""
    t = create(tmp_path / "t.cemb", writers=writers)
    ref = initial()
    rng = np.random.default_rng(0)
    hot = rng.permutation(N)
    sizes = []
    for rnd in range(120):
        values = rng.standard_normal((N, D)).astype(np.float32)
        ids = np.unique(np.concatenate([hot[rng.integers(0, 40, 30)], rng.integers(0, N, 50)]))
        others = np.setdiff1d(rng.integers(0, N, 80), ids)  # read while the write (and cleaning) runs
        ticket = write(t, ids, values, ref)
        got, _ = read(t, others)
        np.testing.assert_array_equal(got, ref[others])
        ticket.wait()
        if rnd % 10 == 9:
            np.testing.assert_array_equal(all_rows(t), ref)
            sizes.append((t.file_bytes() - t.data_offset) // t.block)
    t.drain()
    np.testing.assert_array_equal(all_rows(t), ref)
    stats = t.log.stats
    assert stats["rows_cleaned"] > 0 and stats["blocks_cleaned"] > 0 and t.stats["blocks_copied"] == 0
    # Bounded: a near-uniform write pattern leaves the emptiest blocks ~2/3 live, where moving 2 records per record
    # written (clean_ratio) keeps up; the file stays there, within 3.5x the table (the creation snapshot's
    # blocks, which no later commit released, included).
    assert max(sizes) <= 3.5 * (N // RPB + 1), sizes
    assert t.log.live.sum() == N and (t.log.live >= 0).all()
    t.close()


def test_snapshots_survive_appends_cleaning_rollback_and_a_dead_writer(tmp_path):
    path = tmp_path / "t.cemb"
    t = create(path, slack=0.05)
    ref = initial()
    rng = np.random.default_rng(1)
    snaps = {}
    for rnd in range(40):
        write(t, rng.choice(N, 60, replace=False), rng.standard_normal((N, D)).astype(np.float32), ref).wait()
        if rnd in (9, 19, 29):
            snaps[t.commit({"optimizer_step": rnd})] = ref.copy()
    assert t.log.stats["rows_cleaned"] > 0
    newest = max(snaps)
    t.rollback(newest - 1)  # the older retained snapshot: its records were never overwritten
    np.testing.assert_array_equal(all_rows(t), snaps[newest - 1])
    t.rollback(newest)
    np.testing.assert_array_equal(all_rows(t), snaps[newest])
    for _ in range(10):  # more appends and cleaning after the rollback, then the writer dies
        write(t, rng.choice(N, 60, replace=False), rng.standard_normal((N, D)).astype(np.float32), ref).wait()
    t.drain()
    t._shutdown()
    os.close(t.fd)
    t = TableFile.open(path, writable=True, recover=True)
    assert t.log is not None and t.newest_seq == newest
    np.testing.assert_array_equal(all_rows(t), snaps[newest])
    t.close()


def test_a_file_written_in_place_becomes_a_log_and_stays_one(tmp_path):
    path = tmp_path / "t.cemb"
    t = create(path, log=False)
    ref = initial()
    rng = np.random.default_rng(2)
    write(t, rng.choice(N, 100, replace=False), rng.standard_normal((N, D)).astype(np.float32), ref).wait()
    t.close({"optimizer_step": 1})
    in_place = ref.copy()
    t = TableFile.open(path, log=True)
    assert t.log is not None
    np.testing.assert_array_equal(all_rows(t), ref)
    write(t, rng.choice(N, 100, replace=False), rng.standard_normal((N, D)).astype(np.float32), ref).wait()
    t.close({"optimizer_step": 2})
    t = TableFile.open(path, log=False)  # a log stays a log: its rows are no longer where a chunk map says
    assert t.log is not None and t.index_bytes() == 4 * N
    np.testing.assert_array_equal(all_rows(t), ref)
    t.rollback(min(t.snapshots))  # the in-place snapshot, as a row map
    np.testing.assert_array_equal(all_rows(t), in_place)
    t.close()


def test_a_block_emptied_under_a_read_in_flight_waits_for_it(tmp_path, monkeypatch):
    """Cleaning moves a row while a read of its old record is in flight: the emptied block is not reused (and
    so not overwritten) until that read lands."""
    t = create(tmp_path / "t.cemb", slack=0.01)
    ref = initial()
    gate, real = threading.Event(), TableFile._read_part

    def slow(self, *args):
        gate.wait(5)
        return real(self, *args)

    rng = np.random.default_rng(3)
    for _ in range(5):  # dead records in many blocks: cleaning is due
        write(t, rng.choice(N, 40, replace=False), rng.standard_normal((N, D)).astype(np.float32), ref).wait()
    monkeypatch.setattr(TableFile, "_read_part", slow)
    victim = int(np.argmin(np.where(t.log.live[: N // RPB] > 0, t.log.live[: N // RPB], RPB + 1)))
    rows = np.flatnonzero(t.log.loc // RPB == victim)
    pinned = t.log.pinned.copy()
    t.log.pinned[:] = False  # the creation snapshot's blocks may be cleaned (as after two commits)
    ticket = t.read(rows)
    for _ in range(12):  # enough appends to clean the victim and need new heads
        write(t, np.setdiff1d(rng.choice(N, 40, replace=False), rows),
              rng.standard_normal((N, D)).astype(np.float32), ref).wait()
        assert all(h[0] != victim for h in t.log.heads.values())
    assert t.log.live[victim] == 0 and victim in t.log.held_out
    gate.set()
    records, order = ticket.wait()
    got = t.layout.weight_view(records).numpy()
    np.testing.assert_array_equal(got, ref[rows[order.numpy()]])
    t.log.pinned |= pinned[: t.log.pinned.size]
    monkeypatch.setattr(TableFile, "_read_part", real)
    write(t, rng.choice(N, 40, replace=False), rng.standard_normal((N, D)).astype(np.float32), ref).wait()
    np.testing.assert_array_equal(all_rows(t), ref)
    t.close()


def test_a_damaged_row_map_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "t.cemb"
    t = create(path)
    t.close({"optimizer_step": 1})
    reader = TableFile.open(path, writable=False)
    sb = reader.snapshots[reader.newest_seq][0]
    reader.close()
    before = path.read_bytes()
    os.truncate(path, sb.map_offset + sb.map_bytes // 2)
    with pytest.raises(CorruptTableError, match=str(path)):
        TableFile.open(path, writable=True)
    assert path.read_bytes() == before[: sb.map_offset + sb.map_bytes // 2]  # nothing written


def test_a_log_committed_often_stays_bounded(tmp_path):
    """Checkpoints every few writes: each commit pins every block holding a live record, so blocks whose other
    records died must still be cleaned (their space comes back two commits later), or a block kept by one
    long-lived record would never be reclaimed. Rows still read back as last written, across a reopen."""
    path = tmp_path / "t.cemb"
    t = create(path, slack=0.1)
    ref = initial()
    rng = np.random.default_rng(4)
    hot = rng.permutation(N)[:200]
    sizes = []
    for rnd in range(150):
        values = rng.standard_normal((N, D)).astype(np.float32)
        write(t, np.unique(np.concatenate([rng.choice(hot, 40), rng.integers(0, N, 10)])), values, ref).wait()
        if rnd % 3 == 2:
            t.commit({"optimizer_step": rnd})
            sizes.append((t.file_bytes() - t.data_offset) // t.block)
    np.testing.assert_array_equal(all_rows(t), ref)
    assert t.log.stats["rows_cleaned"] > 0
    assert max(sizes) <= 3.5 * (N // RPB + 1), sizes
    t.close({"optimizer_step": 150})
    t = TableFile.open(path)
    np.testing.assert_array_equal(all_rows(t), ref)
    t.close()
