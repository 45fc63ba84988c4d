"""Sharded tables on file (issue 23): a model built on meta with storage=FileStorage(...) and sharded on spawned
gloo ranks keeps each rank's rows in a file of its own (`<stem>.rank<r>of<w>.cemb`, the rows, rank and world size
in its header), starts from the rows one process draws, and trains exactly as the one-process in-memory model
on the concatenated batches: a single module row-wise, a collection with one table table-wise and one row-wise,
host caches smaller than a rank's rows (eviction to the file). A DCP checkpoint saves each rank's snapshot
descriptor; a second job reopens the rank files, loads it and continues under cachedemb.prefetch equal to the
references (the sharded
in-memory job bit for bit, one process at the sharded tests' tolerance). Another world
size, another rank's file and a table in memory refuse with errors naming the file or key."""
import shutil

import pytest
import torch
from torch import nn

import cachedemb
from cachedemb.distributed import ShardingPlan, TableSharding, gather_full_state_dict, shard
from cachedemb.distributed.checkpoint import load_checkpoint, save_checkpoint
from cachedemb.distributed.files import rank_file, rank_table
from cachedemb.distributed.testing import run_spawned
from cachedemb.storage.format import TableMismatchError

pytestmark = [pytest.mark.usefixtures("write_mode")]  # each file written in place and as a log

TABLES = [cachedemb.TableConfig("ta", 23, 4, ["fa"]), cachedemb.TableConfig("tb", 19, 4, ["fb"])]
N_ROWS, BAGS = 41, 12  # bags per step over all ranks


class _Model(nn.Module):
    def __init__(self, directory=None):
        super().__init__()
        opt = cachedemb.optim.Adam(lr=0.05)
        one = cachedemb.FileStorage(directory / "rows.cemb", host_cache_bytes=1 << 10) if directory else None
        many = cachedemb.FileStorage(directory / "coll", host_cache_bytes=2 << 10) if directory else None
        self.rows = cachedemb.CachedEmbeddingBag(N_ROWS, 4, mode="sum", padding_idx=5, cache_rows=3, optimizer=opt,
                                                 device="meta", storage=one)
        self.coll = cachedemb.CachedEmbeddingBagCollection(TABLES, device="meta", cache_rows=4, optimizer=opt,
                                                           storage=many)
        self.top = nn.Linear(4, 1, device="meta")

    def forward(self, ids, offsets, feats):
        pooled = self.coll(feats)
        return self.top(self.rows(ids, offsets) + pooled["fa"] * pooled["fb"])

    def prefetch_targets(self, batch):  # cachedemb.prefetch of the sharded model: each table's exchange ahead
        ids, offsets, feats = batch
        return self.rows.prefetch_targets((ids, offsets)) + self.coll.prefetch_targets(feats)


def _plan(world):
    return ShardingPlan(world, {"rows": TableSharding.row_wise(N_ROWS, world),
                                "coll.ta": TableSharding.table_wise(23, world - 1, world),
                                "coll.tb": TableSharding.row_wise(19, world)})


def _batch(step: int, b0: int, b1: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, N_ROWS, (2 * BAGS,), generator=g)
    fa, fb = torch.randint(0, 23, (BAGS,), generator=g), torch.randint(0, 19, (BAGS,), generator=g)
    steps = torch.arange(b0, b1 + 1)
    return (ids[2 * b0:2 * b1], 2 * (steps - b0)[:-1],
            {"fa": (fa[b0:b1], steps - b0), "fb": (fb[b0:b1], steps - b0)})


def _train(model, steps, rank=0, world=1, prefetch=False):
    per = BAGS // world
    batches = [_batch(step, rank * per, (rank + 1) * per) for step in steps]
    for batch in cachedemb.prefetch(batches, [model], depth=2, horizon=3) if prefetch else batches:
        model(*batch).square().sum().backward()


def _reference(steps):
    """The one-process in-memory model (materialized from meta), trained on every rank's bags."""
    torch.manual_seed(3)
    model = cachedemb.materialize(_Model(), "cpu")
    for m in model.modules():
        if isinstance(m, cachedemb.CachedEmbeddingBag):
            m._shard_local = True  # a one-process reference inside a rank
    _train(model, steps)
    return {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("top.")}


def _check(got: dict, expected: dict, what: str, exact: bool):
    """Bit for bit against the sharded in-memory job; at the sharded-vs-one-process tolerance of
    tests/test_distributed_meta.py against one process (the owners' pooled parts are summed in another order)."""
    got = {k: v for k, v in got.items() if not k.startswith("top.")}  # dense: DDP averages, one process sums
    expected = {k: v for k, v in expected.items() if not k.startswith("top.")}
    assert sorted(got) == sorted(expected), what
    for key, value in expected.items():
        if exact:
            assert torch.equal(got[key], value), f"{what}: {key}"
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


def _in_memory_sharded(rank: int, world: int, steps) -> dict:
    torch.manual_seed(3)
    model = shard(_Model(), plan=_plan(world))
    _train(model, steps, rank, world)
    return gather_full_state_dict(model)


def _first_job(rank: int, world: int, directory):
    torch.manual_seed(3)
    model = shard(_Model(directory), plan=_plan(world))
    a, b = TableSharding.row_wise(N_ROWS, world).ranges[rank]
    header = model.module.rows.shard.table.header
    assert header.num_rows == b - a and header.shard == {"rank": rank, "world_size": world, "start": a, "end": b,
                                                         "table_rows": N_ROWS}
    assert str(model.module.rows.shard.table.path) == str(rank_file(directory / "rows.cemb", rank, world))
    _train(model, [0, 1], rank, world)
    full = gather_full_state_dict(model)
    save_checkpoint(model, str(directory / "ckpt"))
    stats = [t.shard.cache_stats()["host_cache"] for t in model.sharded_modules().values() if t.shard is not None]
    _train(model, [2], rank, world)  # trained past the checkpoint: the load must roll this back
    model.module.rows.close(), model.module.coll.close()
    in_memory = _in_memory_sharded(rank, world, [0, 1])
    if rank == 0:
        _check(full, in_memory, "after 2 steps, vs sharded in memory", exact=True)
        _check(full, _reference([0, 1]), "after 2 steps, vs one process", exact=False)
    return sum(s["evicted"] for s in stats)


def _second_job(rank: int, world: int, directory):
    torch.manual_seed(3)
    model = shard(_Model(directory), plan=_plan(world))  # opens the rank files
    load_checkpoint(model, str(directory / "ckpt"))
    _train(model, [2, 3, 4], rank, world, prefetch=True)  # the rank files read ahead
    full = gather_full_state_dict(model)
    in_memory = _in_memory_sharded(rank, world, [0, 1, 2, 3, 4])
    if rank == 0:
        _check(full, in_memory, "resumed, vs sharded in memory", exact=True)
        _check(full, _reference([0, 1, 2, 3, 4]), "resumed, vs one process", exact=False)
    return True


def test_sharded_tables_on_file_train_save_resume_as_one_process(tmp_path):
    (tmp_path / "coll").mkdir()
    evicted = run_spawned(_first_job, 2, tmp_path, timeout_s=120.0)
    assert sum(evicted) > 0  # the host caches were smaller than the ranks' rows
    assert sorted(p.name for p in (tmp_path / "coll").glob("*.cemb")) == [
        "ta.rank1of2.cemb", "tb.rank0of2.cemb", "tb.rank1of2.cemb"]  # table-wise ta: only rank 1 keeps rows
    run_spawned(_second_job, 2, tmp_path, timeout_s=120.0)
    torch.manual_seed(3)  # the files of a 2-rank job, opened by a 1-rank job: refused, naming a file
    with pytest.raises(TableMismatchError, match=r"rows\.rank0of2\.cemb.*another world size"):
        rank_table(_Model(tmp_path).rows, 0, N_ROWS, 0, 1, "cpu", "sum")


def test_another_ranks_file_is_refused(tmp_path):
    """Rank 0 finding rank 1's file under its name (copied, or a job with another plan) raises naming it."""
    torch.manual_seed(0)
    opt = cachedemb.optim.RowWiseAdagrad(lr=0.1)

    def meta():
        return cachedemb.CachedEmbeddingBag(10, 3, mode="sum", optimizer=opt, device="meta",
                                            storage=cachedemb.FileStorage(tmp_path / "t.cemb", 4 << 10))

    for rank, (a, b) in enumerate([(0, 5), (5, 10)]):
        rank_table(meta(), a, b, rank, 2, "cpu", "sum").close()
    shutil.copy(rank_file(tmp_path / "t.cemb", 1, 2), rank_file(tmp_path / "t.cemb", 0, 2))
    with pytest.raises(TableMismatchError, match=r"t\.rank0of2\.cemb.*rank 1 of a 2-rank job"):
        rank_table(meta(), 0, 5, 0, 2, "cpu", "sum")
    with pytest.raises(TableMismatchError, match=r"t\.rank1of2\.cemb.*gives that rank none"):
        rank_table(meta(), 0, 0, 1, 2, "cpu", "sum")


def test_streamed_rank_rows_are_one_process_draws(tmp_path):
    """Each rank's file holds exactly the rows one process draws (padding row zeroed), and the generator ends
    where one whole-table draw leaves it, for every rank."""
    opt = cachedemb.optim.SGD(lr=0.1)
    torch.manual_seed(5)
    whole = cachedemb.materialize(cachedemb.CachedEmbeddingBag(37, 5, padding_idx=20, optimizer=opt, device="meta"),
                                  "cpu").cache.host_weight.clone()
    after = torch.rand(3)
    for rank, (a, b) in enumerate(TableSharding.row_wise(37, 3).ranges):
        torch.manual_seed(5)
        m = cachedemb.CachedEmbeddingBag(37, 5, padding_idx=20, optimizer=opt, device="meta",
                                         storage=cachedemb.FileStorage(tmp_path / "w.cemb", 4 << 10))
        table = rank_table(m, a, b, rank, 3, "cpu", "sum")
        assert torch.equal(torch.rand(3), after), rank
        assert torch.equal(table.export_state_dict()["weight"], whole[a:b]), rank
        table.close()


def test_meta_module_on_file_refuses_memory():
    m = cachedemb.CachedEmbeddingBag(10, 3, optimizer=cachedemb.optim.SGD(lr=0.1), device="meta",
                                     storage=cachedemb.FileStorage("/nonexistent/t.cemb", 4 << 10))
    with pytest.raises(ValueError, match=r"storage=FileStorage\('/nonexistent/t.cemb'.*shard"):
        cachedemb.materialize(m, "cpu")


def _other_plan(world):
    return ShardingPlan(world, {"rows": TableSharding.data_parallel(N_ROWS, world),
                                "coll.ta": TableSharding.row_wise(23, world),
                                "coll.tb": TableSharding.table_wise(19, 0, world)})


def _other_plan_job(rank: int, world: int, directory):
    got = []
    for d in (directory, None):  # on file, then in memory
        torch.manual_seed(3)
        model = shard(_Model(d), plan=_other_plan(world))
        _train(model, [0, 1, 2], rank, world)
        got.append(gather_full_state_dict(model))
    if rank == 0:
        _check(got[0], got[1], "data-parallel on file, vs sharded in memory", exact=True)
        _check(got[0], _reference([0, 1, 2]), "data-parallel on file, vs one process", exact=False)
    return True


@pytest.mark.slow
def test_data_parallel_table_on_file(tmp_path):
    """A data-parallel table on file: every rank a whole replica in its own file, kept equal by the exchange."""
    (tmp_path / "coll").mkdir()
    run_spawned(_other_plan_job, 2, tmp_path, timeout_s=120.0)
    assert sorted(p.name for p in tmp_path.glob("*.cemb")) == ["rows.rank0of2.cemb", "rows.rank1of2.cemb"]
