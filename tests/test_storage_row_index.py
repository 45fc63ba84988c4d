"""The file tier's host id -> slab row index (cachedemb.storage.row_index): its C loops (row_index.c) and the
torch reference (kernels.id_index) keep what a dict keeps, through inserts, deletes, tombstone reuse, probes past
MAX_PROBE and rebuilds, and lookups of the C loops read a layout the reference wrote (the same layout rules)."""
from __future__ import annotations

import numpy as np
import pytest

from cachedemb.kernels import id_index
from cachedemb.storage import row_index
from cachedemb.storage.row_index import RowIndex


@pytest.fixture(params=["c", "torch"])
def index_loops(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(row_index.NATIVE, "enabled", False)
    elif row_index.NATIVE.get() is None:
        pytest.skip("C helpers off: the torch reference runs")
    return request.param


def _live(truth):
    ids = np.fromiter(truth.keys(), dtype=np.int64, count=len(truth))
    return ids, np.fromiter((truth[i] for i in ids.tolist()), dtype=np.int64, count=ids.size)


@pytest.mark.parametrize("id_range", [10 ** 9, 4096])  # sparse ids, and dense ones whose chains collide
def test_row_index_keeps_what_a_dict_keeps(id_range, index_loops):
    rng = np.random.default_rng(7)
    index, truth = RowIndex(64), {}
    free = list(range(64))
    for step in range(60):
        if truth and rng.random() < 0.5:  # evict a batch
            gone = rng.choice(np.fromiter(truth, dtype=np.int64), size=min(len(truth), int(rng.integers(1, 40))),
                              replace=False)
            index.delete(gone)
            for i in gone.tolist():
                free.append(truth.pop(i))
        want = int(rng.integers(1, 60))
        new = rng.choice(id_range, size=want, replace=False).astype(np.int64)
        new = new[~np.isin(new, np.fromiter(truth, dtype=np.int64, count=len(truth)))]
        if len(free) < new.size:  # more rows, as staging rows grow the slab
            free.extend(range(64 + step * 100, 64 + step * 100 + new.size))
        rows = np.array([free.pop() for _ in range(new.size)], dtype=np.int64)
        index.insert(new, rows, lambda: _live(truth))
        truth.update(zip(new.tolist(), rows.tolist()))
        ids, at = _live(truth)
        assert np.array_equal(index.lookup(ids), at)
        absent = rng.choice(id_range, size=50).astype(np.int64)
        absent = absent[~np.isin(absent, ids)]
        assert (index.lookup(absent) == -1).all()
        assert (index.lookup(np.array([-1, -5], dtype=np.int64)) == -1).all()
        keys = index.keys.numpy()
        assert np.count_nonzero(keys >= 0) == len(truth)


def test_an_insert_past_max_probe_lays_the_index_out_larger(index_loops, monkeypatch):
    """Ids whose chains would run past MAX_PROBE are not placed there: the index doubles and is rebuilt."""
    monkeypatch.setattr(id_index, "MAX_PROBE", 2)
    index, truth = RowIndex(512), {}
    size = index.keys.numel()
    ids = np.arange(600, dtype=np.int64)  # load > 1/2 of 2048 positions: some chain is longer than 2
    rows = np.arange(600, dtype=np.int64)
    index.insert(ids, rows, lambda: _live(truth))
    assert index.keys.numel() > size
    assert np.array_equal(index.lookup(ids), rows)


def test_the_c_loops_read_and_change_a_layout_the_reference_wrote(monkeypatch):
    if row_index.NATIVE.get() is None:
        pytest.skip("C helpers off")
    rng = np.random.default_rng(3)
    ids = rng.choice(10 ** 9, size=300, replace=False).astype(np.int64)
    rows = np.arange(300, dtype=np.int64)
    index = RowIndex(256)
    monkeypatch.setattr(row_index.NATIVE, "enabled", False)
    index.insert(ids, rows, lambda: (np.empty(0, np.int64), np.empty(0, np.int64)))
    index.delete(ids[:100])
    monkeypatch.setattr(row_index.NATIVE, "enabled", True)
    assert np.array_equal(index.lookup(ids[100:]), rows[100:])
    assert (index.lookup(ids[:100]) == -1).all()
    index.insert(ids[:100], rows[:100], lambda: (ids[100:], rows[100:]))  # reuses the reference's tombstones
    monkeypatch.setattr(row_index.NATIVE, "enabled", False)
    assert np.array_equal(index.lookup(ids), rows)


def test_a_rebuild_keeps_every_id_and_clears_the_tombstones(index_loops):
    rng = np.random.default_rng(11)
    ids = rng.choice(10 ** 9, size=200, replace=False).astype(np.int64)
    rows = rng.permutation(200).astype(np.int64)
    index = RowIndex(128)
    index.insert(ids, rows, lambda: (np.empty(0, np.int64), np.empty(0, np.int64)))
    index.delete(ids[:150])
    assert (index.keys.numpy() == id_index.TOMB).sum() == 150
    index.rebuild(ids[150:], rows[150:])
    keys = index.keys.numpy()
    assert (keys == id_index.TOMB).sum() == 0 and (keys >= 0).sum() == 50
    assert np.array_equal(index.lookup(ids[150:]), rows[150:])
    assert (index.lookup(ids[:150]) == -1).all()
    with pytest.raises(ValueError, match="cannot hold"):
        index.rebuild(np.arange(index.keys.numel(), dtype=np.int64), np.arange(index.keys.numel(), dtype=np.int64))
