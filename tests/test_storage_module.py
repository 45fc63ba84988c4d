"""A table on file trains exactly as in memory: `CachedEmbeddingBag(..., storage=FileStorage(...))` against an
in-memory CachedEmbeddingBag on the same batches, bit for bit (outputs every step, then rows, optimizer state and
step), for every fused optimizer, at host caches larger and smaller than one batch, device caches of several
sizes, with and without prefetch, in both sizing modes; reopening continues; bad use is refused."""
from __future__ import annotations

import os
import numpy as np
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb import optim
from cachedemb.modules.errors import InvalidIdError
from cachedemb.storage.embedding_bag import state_columns
from cachedemb.storage.host_cache import slab_rows
from cachedemb.storage.format import TableHeader, TableMismatchError

pytestmark = [pytest.mark.usefixtures("sizing_mode", "write_mode")]

N, D, BAGS, STEPS = 400, 8, 12, 14
SPECS = {"sgd": optim.SGD(lr=0.1), "adagrad": optim.Adagrad(lr=0.1, initial_accumulator_value=0.1),
         "rowwise_adagrad": optim.RowWiseAdagrad(lr=0.1), "adam": optim.Adam(lr=0.01)}


def batches(seed=0, steps=STEPS, with_weights=False):
    rng = np.random.default_rng(seed)
    p = np.arange(1, N + 1, dtype=np.float64) ** -1.05
    p /= p.sum()
    perm = rng.permutation(N)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 9, BAGS)
        ids = torch.from_numpy(perm[rng.choice(N, size=int(lengths.sum()), p=p)])
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        psw = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(int(lengths.sum())))
        target = torch.randn(BAGS, D, generator=torch.Generator().manual_seed(int(lengths[0])))
        out.append((ids, offsets, psw if with_weights else None, target))
    return out


def host_bytes_for(rows, spec):
    """host_cache_bytes that give `rows` slab rows for this optimizer's records."""
    record = TableHeader(N, D, torch.float32, state_columns(spec, D), "", 1, "", "", 0).layout.record_bytes
    budget = next(b for b in range(rows * record, rows * (record + 200)) if slab_rows(b, record) > rows)
    assert slab_rows(budget, record) == rows + 1  # the slab and the padding row
    return budget + log_row_map_bytes(N)


def log_row_map_bytes(num_rows):
    """The row map a table written as a log takes out of host_cache_bytes (write_mode "log")."""
    return 4 * num_rows if os.environ.get("CACHEDEMB_STORAGE_LOG") == "1" else 0


def pair(tmp_path, spec, host_rows, cache_rows, name="t", windows=True, **kw):
    torch.manual_seed(0)
    weight = torch.randn(N, D)
    ref = cachedemb.CachedEmbeddingBag(N, D, cache_rows=cache_rows, optimizer=spec, _weight=weight.clone(),
                                       device="cpu", **kw)
    ours = cachedemb.CachedEmbeddingBag(N, D, cache_rows=cache_rows, optimizer=spec, _weight=weight.clone(),
                                        device="cpu", **kw, storage=cachedemb.FileStorage(
                                            tmp_path / f"{name}.cemb", host_cache_bytes=host_bytes_for(host_rows, spec),
                                            device_windows=windows))
    return ref, ours


def step(module, ids, offsets, psw, target):
    out = module(ids, offsets, psw)
    (torch.tanh(out) * target).sum().backward()
    return out.detach()


def assert_same_table(ref, ours):
    want, got = ref.state_dict(), ours.export_state_dict()
    assert set(want) == set(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("host_rows,cache_rows", [(120, 16), (30, 30), (7, 3)], ids=["host>batch", "host<batch",
                                                                                        "host<<batch"])
def test_file_table_trains_as_in_memory(tmp_path, name, host_rows, cache_rows):
    ref, ours = pair(tmp_path, SPECS[name], host_rows, cache_rows, mode="sum")
    for ids, offsets, psw, target in batches():
        assert torch.equal(step(ref, ids, offsets, psw, target), step(ours, ids, offsets, psw, target))
    assert_same_table(ref, ours)
    stats = ours.cache_stats()
    assert stats["host_cache"]["evicted"] > 0 and stats["file"]["rows_written"] > 0
    if host_rows < 40:  # batches have ~35-50 distinct ids: staging rows were needed, and given back
        assert stats["host_cache"]["staging_rows"] > 0 and ours.host.num_rows > ours.host.base
        ids, offsets, psw, target = batches(seed=1, steps=1)[0]
        step(ours, ids[:2], torch.tensor([0]), None, target[:1])
        assert ours.host.num_rows == ours.host.base
    ours.close()


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("writers", [1, 3])
def test_a_log_cleaned_as_it_trains_stays_equal_to_in_memory(tmp_path, name, writers, monkeypatch, write_mode):
    """A table file written as a log with little slack: dead records are cleaned (live ones moved out of the
    emptiest blocks) while it trains, on one writer and on three; still equal to in memory, and the file stays
    bounded."""
    from cachedemb.storage import table_file

    if write_mode != "log":
        pytest.skip("the log's cleaning")
    monkeypatch.setattr(table_file, "default_writers", lambda io_threads: writers)
    torch.manual_seed(0)
    weight = torch.randn(N, D)
    ref = cachedemb.CachedEmbeddingBag(N, D, cache_rows=8, optimizer=SPECS[name], _weight=weight.clone(),
                                       device="cpu", mode="sum")
    ours = cachedemb.CachedEmbeddingBag(N, D, cache_rows=8, optimizer=SPECS[name], _weight=weight.clone(),
                                        device="cpu", mode="sum", storage=cachedemb.FileStorage(
                                            tmp_path / "t.cemb", host_cache_bytes=host_bytes_for(30, SPECS[name]),
                                            rows_per_block=8, log_slack=0.05))
    for i, (ids, offsets, psw, target) in enumerate(batches(seed=5, steps=40)):
        assert torch.equal(step(ref, ids, offsets, psw, target), step(ours, ids, offsets, psw, target))
        if i == 20:
            ours.commit()
    assert_same_table(ref, ours)
    log = ours.table.log.stats
    assert log["rows_cleaned"] > 0 and log["blocks_cleaned"] > 0 and ours.table.stats["blocks_copied"] == 0
    # blocks: the live table and two snapshots with their slack, the maps and a head per writer
    blocks = (ours.table.file_bytes() - 16384) // ours.table.block
    assert blocks <= 3 * (N // 8) * 1.05 + 6 + writers
    ours.close()


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_several_writer_threads_train_as_in_memory(tmp_path, name, monkeypatch):
    """Write-backs spread over three writer threads (a many-core machine's default): still equal to in memory."""
    from cachedemb.storage import table_file

    monkeypatch.setattr(table_file, "default_writers", lambda io_threads: 3)
    ref, ours = pair(tmp_path, SPECS[name], 30, 8, mode="sum")
    assert len(ours.table._writers) == 3
    for ids, offsets, psw, target in batches(seed=3):
        assert torch.equal(step(ref, ids, offsets, psw, target), step(ours, ids, offsets, psw, target))
    assert_same_table(ref, ours)
    assert ours.cache_stats()["file"]["rows_written"] > 0
    ours.close()


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_rows_reloaded_while_their_write_back_is_in_flight(tmp_path, name, monkeypatch):
    """A slow writer (a write takes two steps, or 0.2 s if the loop waits for it): rows evicted and needed again
    before their write lands are copied from the write's records (not waited for, not read back stale), and
    training stays equal to in memory."""
    import threading

    from cachedemb.storage.table_file import TableFile

    real, turn = TableFile._write_task, threading.Semaphore(0)

    def slow(self, *args):
        turn.acquire(timeout=0.1)
        turn.acquire(timeout=0.1)
        return real(self, *args)

    monkeypatch.setattr(TableFile, "_write_task", slow)
    ref, ours = pair(tmp_path, SPECS[name], 30, 8, mode="sum")
    for ids, offsets, psw, target in batches(seed=7, steps=12):
        assert torch.equal(step(ref, ids, offsets, psw, target), step(ours, ids, offsets, psw, target))
        turn.release()
    assert_same_table(ref, ours)
    assert ours.cache_stats()["host_cache"]["from_writes"] > 0
    ours.close()


def test_a_row_in_two_writes_in_flight_is_reloaded_from_the_newest(tmp_path, monkeypatch):
    import threading

    from cachedemb.storage.table_file import TableFile

    _, ours = pair(tmp_path, SPECS["sgd"], 30, 8, mode="sum")
    ids, offsets, psw, target = batches(seed=8, steps=1)[0]
    step(ours, ids, offsets, psw, target)
    host, cache = ours.host, ours.inner.cache
    ours.inner.cache.flush()
    row = int(np.flatnonzero(host.row_id >= 0)[0])
    gate, real = threading.Event(), TableFile._write_task
    monkeypatch.setattr(TableFile, "_write_task", lambda self, *a: (gate.wait(), real(self, *a)))
    try:
        for value in (1.0, 2.0):  # two write-backs of the row, both held back by the writer
            cache.host_weight[row] = value
            host.dirty[row] = True
            host.write_back(np.array([row]))
            host.finish_packs()  # a slab row is reused only once the write-backs reading it are packed
        cache.host_weight[row] = -7.0  # the slab row is reused ...
        host._load(host.row_id[[row]], np.array([row]))  # ... and the row is read again
        assert torch.equal(cache.host_weight[row], torch.full((D,), 2.0))
        assert host.stats["from_writes"] == 1
    finally:
        gate.set()
    ours.table.drain()
    ours.close()


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_modes_padding_and_weights(tmp_path, mode):
    kw = dict(mode=mode, padding_idx=5)
    ref, ours = pair(tmp_path, SPECS["adagrad"], 25, 6, **kw)
    for ids, offsets, _, target in batches(seed=3):
        ids = torch.where(ids % 7 == 0, torch.full_like(ids, 5), ids)
        assert torch.equal(step(ref, ids, offsets, None, target), step(ours, ids, offsets, None, target))
    assert_same_table(ref, ours)
    ref, ours = pair(tmp_path, SPECS["sgd"], 25, 6, mode="sum", name="psw")
    for ids, offsets, psw, target in batches(seed=4, with_weights=True):
        assert torch.equal(step(ref, ids, offsets, psw, target), step(ours, ids, offsets, psw, target))
    assert_same_table(ref, ours)


@pytest.mark.parametrize("host_rows,windows", [(200, True), (40, True), (200, False)])
def test_prefetch_trains_as_in_memory(tmp_path, host_rows, windows):
    """Read ahead (depth 2, horizon 4): misses read from the file in the background, windows admitted from the
    slab (or, without device windows, only the file reads ahead); with a host cache too small for the horizon
    the read-ahead pauses and forwards map their batches."""
    ref, ours = pair(tmp_path, SPECS["adam"], host_rows, 24, mode="sum", windows=windows)
    data = batches(seed=5, steps=16)
    expected = [step(ref, *b) for b in data]
    got = [step(ours, *b) for b in cachedemb.prefetch(data, [ours], depth=2, horizon=4)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert_same_table(ref, ours)
    assert (ours.cache_stats()["windows"] > 0) == windows and ours.cache_stats()["file"]["rows_read"] > 0
    # and again, with an eval forward in the middle of the loop
    more = batches(seed=6, steps=8)
    for i, b in enumerate(cachedemb.prefetch(more, [ours], depth=2, horizon=4)):
        if i == 3:
            with torch.no_grad():
                assert torch.equal(ours(*more[0][:3]), ref(*more[0][:3]))
        assert torch.equal(step(ref, *b), step(ours, *b))
    assert_same_table(ref, ours)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("host_rows", [200, 60])
def test_the_mapper_maps_ahead_beside_the_step(tmp_path, monkeypatch, name, host_rows):
    """Without device windows the read-ahead batches are mapped on the host cache's mapper thread while the
    batch before them runs forward and backward. A slowed mapper (each job held until the training thread's
    inner forward and backward have started) still trains exactly as in memory; the jobs ran, and ran beside
    the training thread; a host cache too small for the read-ahead falls back to mapping at the forward."""
    import threading
    import time

    from cachedemb.storage.embedding_bag import FileBackedEmbeddingBag

    ref, ours = pair(tmp_path, SPECS[name], host_rows, 24, mode="sum", windows=False)
    real, overlapped = FileBackedEmbeddingBag._map_ahead, []
    inner_started = threading.Event()
    real_inner = ours.inner.forward

    def inner_forward(*args, **kwargs):
        inner_started.set()
        return real_inner(*args, **kwargs)

    def slow_map_ahead(self):
        overlapped.append(inner_started.wait(1.0))
        time.sleep(0.002)
        inner_started.clear()
        return real(self)

    monkeypatch.setattr(ours.inner, "forward", inner_forward)
    monkeypatch.setattr(FileBackedEmbeddingBag, "_map_ahead", slow_map_ahead)
    data = batches(seed=11, steps=20)
    for b in cachedemb.prefetch(data, [ours], depth=1, horizon=6):
        assert torch.equal(step(ref, *b), step(ours, *b))
    assert_same_table(ref, ours)
    stats = ours.cache_stats()["host_cache"]
    assert stats["mapped_in_background"] > 0 and len(overlapped) >= 10 and all(overlapped)
    assert stats["misses"] > 0 and stats["evicted"] > 0
    ours.close()


def test_a_module_dropped_beside_its_mapper_is_closed_with_every_step(tmp_path):
    """A module let go in the middle of a prefetch loop (no close) is flushed and committed when collected,
    whichever thread drops it last (the mapper's job keeps no reference to it): reopened, it holds every step."""
    import gc

    spec = SPECS["adagrad"]
    ref, ours = pair(tmp_path, spec, 60, 8, mode="sum", windows=False)
    data = batches(seed=13, steps=12)
    loop = iter(cachedemb.prefetch(data, [ours], depth=1, horizon=4))
    for _ in range(7):
        b = next(loop)
        step(ref, *b), step(ours, *b)
    assert ours.cache_stats()["host_cache"]["mapped_in_background"] > 0
    del loop, ours, b
    gc.collect()
    again = cachedemb.CachedEmbeddingBag(N, D, mode="sum", cache_rows=8, optimizer=spec, device="cpu",
                                         storage=cachedemb.FileStorage(tmp_path / "t.cemb",
                                                                       host_cache_bytes=host_bytes_for(60, spec)))
    assert again.optimizer_step == 7
    assert_same_table(ref, again)
    again.close()


def test_a_mapper_error_is_raised_at_the_next_forward(tmp_path, monkeypatch):
    from cachedemb.storage.table_file import TableFile

    ref, ours = pair(tmp_path, SPECS["sgd"], 200, 24, mode="sum", windows=False)
    data = batches(seed=12, steps=10)
    loop = iter(cachedemb.prefetch(data, [ours], depth=1, horizon=4))
    for _ in range(2):
        step(ours, *next(loop))

    def broken(self, *args, **kwargs):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(TableFile, "read", broken)
    with pytest.raises(OSError, match="injected"):
        for _ in range(8):
            step(ours, *next(loop))
    monkeypatch.undo()
    del loop
    ours.close()


def test_reopen_continues_training(tmp_path):
    spec = SPECS["adam"]
    ref, ours = pair(tmp_path, spec, 50, 8, mode="sum")
    data = batches(seed=7, steps=20)
    for b in data[:10]:
        step(ref, *b), step(ours, *b)
    ours.close()
    again = cachedemb.CachedEmbeddingBag(N, D, mode="sum", cache_rows=8, optimizer=spec, device="cpu",
                                         storage=cachedemb.FileStorage(tmp_path / "t.cemb",
                                                                       host_cache_bytes=host_bytes_for(50, spec)))
    assert again.optimizer_step == 10
    for b in data[10:]:
        assert torch.equal(step(ref, *b), step(again, *b))
    assert_same_table(ref, again)
    again.close()


def test_state_dict_is_a_snapshot_and_load_rolls_back(tmp_path):
    ref, ours = pair(tmp_path, SPECS["rowwise_adagrad"], 60, 8, mode="sum")
    data = batches(seed=8, steps=12)
    for b in data[:6]:
        step(ours, *b), step(ref, *b)
    sd = ours.state_dict()
    assert set(sd) == {"storage.uuid", "storage.snapshot", "optimizer.step"}
    saved = ref.state_dict()
    saved = {k: v.clone() for k, v in saved.items()}
    for b in data[6:]:
        step(ours, *b)
    ours.load_state_dict(sd)
    assert ours.optimizer_step == 6
    got = ours.export_state_dict()
    assert all(torch.equal(saved[k], got[k]) for k in saved)
    for b in data[6:]:  # and training continues from there exactly
        assert torch.equal(step(ref, *b), step(ours, *b))
    _, other = pair(tmp_path, SPECS["rowwise_adagrad"], 60, 8, mode="sum", name="other")
    with pytest.raises(RuntimeError, match="another table's file"):
        other.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="snapshot descriptor"):
        other.load_state_dict(ref.state_dict())
    ours.close(), other.close()


def test_streamed_creation_and_export(tmp_path):
    torch.manual_seed(11)
    plain = nn.EmbeddingBag(N, D, mode="sum")  # nn's N(0, 1) init
    after_plain = torch.randn(3)
    torch.manual_seed(11)
    ours = cachedemb.CachedEmbeddingBag(N, D, mode="sum", optimizer=SPECS["sgd"], device="cpu",
                                        storage=cachedemb.FileStorage(tmp_path / "init.cemb", host_cache_bytes=1 << 16))
    assert torch.equal(torch.randn(3), after_plain)  # the generator ends where nn's init leaves it
    assert torch.equal(ours.to_embedding_bag().weight, plain.weight)  # the same draws, streamed in chunks
    frozen = cachedemb.CachedEmbeddingBag.from_pretrained(plain.weight.detach(), mode="sum", device="cpu",
                                                          storage=cachedemb.FileStorage(tmp_path / "pre.cemb", 1 << 14))
    ids, offsets = torch.tensor([1, 2, 399, 4, 2]), torch.tensor([0, 2])
    assert torch.equal(frozen(ids, offsets), plain(ids, offsets))
    assert torch.equal(frozen.to_embedding_bag().weight, plain.weight)
    with pytest.raises(AttributeError, match="not held in memory"):
        frozen.weight
    ours.close(), frozen.close()


def test_bad_use_is_refused(tmp_path):
    path = tmp_path / "t.cemb"
    store = cachedemb.FileStorage(path, host_cache_bytes=1 << 15)
    with pytest.raises(ValueError, match="fused sparse optimizer"):
        cachedemb.CachedEmbeddingBag(N, D, storage=store)
    m = cachedemb.CachedEmbeddingBag(N, D, optimizer=SPECS["sgd"], device="cpu", storage=store)
    with pytest.raises(InvalidIdError, match="out of range"):
        m(torch.tensor([1, N]), torch.tensor([0]))
    m.close()
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="never overwrites"):
        cachedemb.CachedEmbeddingBag(N, D, optimizer=SPECS["sgd"], _weight=torch.zeros(N, D), storage=store)
    with pytest.raises(TableMismatchError, match=f"{path}.*not the {N} x 16"):
        cachedemb.CachedEmbeddingBag(N, 16, optimizer=SPECS["sgd"], storage=store)
    with pytest.raises(TableMismatchError, match=r"written by SGD \(no per-row state\); this module uses Adam "
                                                 r"\(per-row state: exp_avg, \d+ columns, exp_avg_sq"):
        cachedemb.CachedEmbeddingBag(N, D, optimizer=SPECS["adam"], storage=store)
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match="host_cache_bytes"):
        cachedemb.FileStorage(path, host_cache_bytes=0)
    for bad in (0, -1, True, 2.0, None):
        with pytest.raises(ValueError, match=f"io_threads must be a positive int, got {bad!r}"):
            cachedemb.FileStorage(path, host_cache_bytes=1 << 15, io_threads=bad)


def test_dropped_module_commits_its_rows(tmp_path):
    """A module dropped without close() is flushed and committed when collected: the file opens cleanly (no
    dead writer) with every update; copies are refused (the state is the file)."""
    import copy
    import gc

    ref, ours = pair(tmp_path, SPECS["adagrad"], 60, 8, mode="sum")
    for b in batches(seed=9, steps=5):
        step(ref, *b), step(ours, *b)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(ours)
    store = ours.storage
    del ours
    gc.collect()
    again = cachedemb.CachedEmbeddingBag(N, D, mode="sum", cache_rows=8, optimizer=SPECS["adagrad"], device="cpu",
                                         storage=store)
    assert again.optimizer_step == 5
    assert_same_table(ref, again)
    again.close()


def test_slab_unique_is_the_inner_forwards_unique_ids():
    """The unique slab rows the mapper hands the inner forward equal what its own `unique_ids` would compute
    from the batch's rows (values and dtypes, groups included)."""
    from cachedemb import kernels
    from cachedemb.storage.host_cache import distinct

    rng = np.random.default_rng(0)
    for trial in range(40):
        lookups, ids = int(rng.integers(2, 3000)), int(rng.integers(2, 5000))
        flat = torch.from_numpy(rng.integers(0, ids, lookups))
        batch = distinct(flat, groups=True)
        assert np.array_equal(batch.ids, np.unique(flat.numpy()))
        rows = rng.permutation(10 * ids)[: batch.ids.size] + 1  # distinct slab rows, in no order
        got = batch.slab_unique(rows)
        want = kernels.unique_ids(torch.from_numpy(rows[batch.inverse]), None, return_groups=True)
        for a, b in zip(list(got[:4]) + list(got[4]), list(want[:4]) + list(want[4])):
            assert a.dtype == b.dtype and torch.equal(a, b), trial
