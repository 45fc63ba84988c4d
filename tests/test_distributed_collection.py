"""Sharded CachedEmbeddingBagCollection (KJT in, KeyedTensor out) on spawned gloo ranks against the
single-process collection trained on the concatenated batches: tables spread table-wise by the default plan
(one also row-wise by hand), uneven local batch sizes, one rank with an empty batch."""
import pytest
import torch

import cachedemb
from cachedemb import CachedEmbeddingBagCollection, TableConfig
from cachedemb.distributed import ShardingType, TableSharding, gather_full_state_dict, plan_for, shard
from cachedemb.distributed.testing import run_spawned
from conftest import needs_torchrec

TABLES = [TableConfig("t1", 11, 4, ("f1", "f2")), TableConfig("t2", 7, 4, ("f3",), pooling="mean"),
          TableConfig("t3", 9, 3, ("f4",))]
KEYS = ["f1", "f2", "f3", "f4"]
ROWS = {"f1": 11, "f2": 11, "f3": 7, "f4": 9}


def _collection(optimizer):
    torch.manual_seed(0)
    ebc = CachedEmbeddingBagCollection(TABLES, device="cpu", cache_rows=3, optimizer=optimizer)
    for bag in ebc.bags:
        bag._shard_local = True
    return ebc


def _batch(world: int, step: int):
    g = torch.Generator().manual_seed(step)
    sizes = [0 if r == world - 1 else 2 + r + step % 2 for r in range(world)]
    total = sum(sizes)
    per_key = {}
    for key in KEYS:
        lengths = torch.randint(0, 4, (total,), generator=g)
        per_key[key] = (torch.randint(0, ROWS[key], (int(lengths.sum()),), generator=g), lengths)
    return sizes, per_key, torch.randn(total, 15, generator=g)


def _kjt(per_key, b0: int, b1: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values, lengths = [], []
    for key in KEYS:
        ids, lens = per_key[key]
        i0, i1 = int(lens[:b0].sum()), int(lens[:b1].sum())
        values.append(ids[i0:i1])
        lengths.append(lens[b0:b1])
    return KeyedJaggedTensor(keys=KEYS, values=torch.cat(values), lengths=torch.cat(lengths), stride=b1 - b0)


def _worker(rank: int, world: int, optimizer_name: str, row_wise_t1: bool):
    optimizer = {"adam": cachedemb.optim.Adam(lr=0.1), "rowwise_adagrad": cachedemb.optim.RowWiseAdagrad(lr=0.2)}
    reference, model = _collection(optimizer[optimizer_name]), _collection(optimizer[optimizer_name])
    plan = plan_for(model, world)
    if row_wise_t1:
        plan.tables["t1"] = TableSharding.row_wise(11, world)
    assert all(t.sharding_type == ShardingType.TABLE_WISE for n, t in plan.tables.items() if n != "t1")
    sharded = shard(model, plan)
    for step in range(3):
        sizes, per_key, target = _batch(world, step)
        b0, b1 = sum(sizes[:rank]), sum(sizes[:rank + 1])
        out = sharded(_kjt(per_key, b0, b1))
        ref = reference(_kjt(per_key, 0, sum(sizes)))
        assert out.keys() == ref.keys()
        torch.testing.assert_close(out.values(), ref.values()[b0:b1], atol=1e-5, rtol=1e-5)
        (out.values() * target[b0:b1]).sum().backward()
        (ref.values() * target).sum().backward()
    full = gather_full_state_dict(sharded)
    if rank == 0:
        expected = reference.state_dict()
        assert sorted(full) == sorted(expected), (sorted(full), sorted(expected))
        for key, value in expected.items():
            torch.testing.assert_close(full[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
        _collection(optimizer[optimizer_name]).load_state_dict(full)
    return str(sharded.plan)


@needs_torchrec
@pytest.mark.slow
@pytest.mark.parametrize("world,optimizer,row_wise_t1", [(2, "adam", False), (3, "rowwise_adagrad", True)])
def test_sharded_collection_equals_single_process(world, optimizer, row_wise_t1):
    plans = run_spawned(_worker, world, optimizer, row_wise_t1)
    assert "table_wise" in plans[0]
