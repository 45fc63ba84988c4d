"""A model with cached tables and dense layers under shard(): the dense part in DDP, torch optimizers on
optimizer=None tables, the plan, and failure behaviour (a raising rank fails the job, no hang)."""
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb.distributed import ShardingPlan, TableSharding, default_plan, gather_full_state_dict, shard
from cachedemb.distributed.testing import run_spawned


class _Model(nn.Module):
    def __init__(self, optimizer):
        super().__init__()
        self.big = cachedemb.CachedEmbeddingBag(20, 4, mode="sum", cache_rows=4, optimizer=optimizer, device="cpu")
        self.small = cachedemb.CachedEmbeddingBag(6, 4, mode="mean", cache_rows=2, optimizer=optimizer,
                                                  device="cpu")
        self.dense = nn.Linear(8, 1)

    def forward(self, ids_big, off_big, ids_small, off_small):
        return self.dense(torch.cat([self.big(ids_big, off_big), self.small(ids_small, off_small)], 1))


def _batch(world: int, step: int):
    g = torch.Generator().manual_seed(step)
    sizes = [3 + r if r != world - 1 else 0 for r in range(world)]
    out = []
    for rows in (20, 6):
        lengths = torch.randint(1, 4, (sum(sizes),), generator=g)
        out.append((torch.randint(0, rows, (int(lengths.sum()),), generator=g), lengths))
    return sizes, out, torch.randn(sum(sizes), 1, generator=g)


def _local(sizes, table, rank):
    ids, lengths = table
    b0, b1 = sum(sizes[:rank]), sum(sizes[:rank + 1])
    i0, i1 = int(lengths[:b0].sum()), int(lengths[:b1].sum())
    return ids[i0:i1], torch.cat([torch.zeros(1, dtype=torch.int64), lengths[b0:b1].cumsum(0)])[:-1]


def _global(table):
    ids, lengths = table
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])


def _mark(model):
    for m in model.modules():
        if isinstance(m, cachedemb.CachedEmbeddingBag):
            m._shard_local = True


def _dense_model_worker(rank: int, world: int, fused: bool):
    opt = cachedemb.optim.Adagrad(lr=0.2) if fused else None
    torch.manual_seed(0)
    reference = _Model(opt)
    torch.manual_seed(0)
    model = _Model(opt)
    _mark(reference)
    plan = ShardingPlan(world, {"big": TableSharding.row_wise(20, world),
                                "small": TableSharding.data_parallel(6, world)})
    sharded = shard(model, plan)
    assert sharded._ddp, "dense parameters go to DDP"
    params = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    sgd, ref_sgd = torch.optim.SGD(params(sharded), lr=0.1), torch.optim.SGD(params(reference), lr=0.1)
    for step in range(3):
        sizes, tables, target = _batch(world, step)
        b0 = sum(sizes[:rank])
        local = [_local(sizes, t, rank) for t in tables]
        out = sharded(*local[0], *local[1])
        ref_out = reference(*_global(tables[0]), *_global(tables[1]))
        torch.testing.assert_close(out, ref_out[b0:b0 + out.shape[0]], atol=1e-5, rtol=1e-5)
        # Embedding gradients are those of the sum of the ranks' losses; DDP averages the dense ones.
        ((out - target[b0:b0 + out.shape[0]]) ** 2).sum().backward()
        ((ref_out - target) ** 2).sum().backward()
        for p in reference.dense.parameters():
            p.grad /= world
        sgd.step(), ref_sgd.step()
        sgd.zero_grad(), ref_sgd.zero_grad()
    full = gather_full_state_dict(sharded)
    if rank == 0:
        expected = reference.state_dict()
        assert sorted(full) == sorted(expected)
        for key, value in expected.items():
            torch.testing.assert_close(full[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    return True


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["adagrad_fused", "torch_sgd"])
def test_dense_model_under_ddp_equals_single_process(fused):
    assert run_spawned(_dense_model_worker, 2, fused) == [True, True]


def _raising_worker(rank: int, world: int):
    model = shard(cachedemb.CachedEmbeddingBag(8, 2, mode="sum", cache_rows=2, device="cpu"),
                  {"": TableSharding.row_wise(8, world)})
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    model(torch.tensor([1, 7]), torch.tensor([0]))  # rank 0 waits in the exchange until the timeout


@pytest.mark.slow
def test_a_raising_rank_fails_the_job_without_hanging():
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        run_spawned(_raising_worker, 2, timeout_s=10)


def test_plan_is_printable_and_round_trips():
    plan = default_plan({"big": (1000, 16, 4, 0.0), "a": (10, 16, 4, 0.0), "b": (20, 16, 4, 0.0)}, 2)
    text = str(plan)
    assert "big: row_wise r0:[0,500), r1:[500,1000)" in text and "table_wise" in text
    assert ShardingPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="tile"):
        TableSharding("row_wise", 10, ((0, 4), (5, 10)))
    with pytest.raises(ValueError, match="every rank keeps"):
        TableSharding("data_parallel", 10, ((0, 10), (0, 5)))


def test_shard_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard(cachedemb.CachedEmbeddingBag(4, 2, device="cpu"))
