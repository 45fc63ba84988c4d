"""torch.distributed.checkpoint of a sharded model: saved at 2 ranks (row-wise, table-wise and data-parallel
tables with fused Adam state, a dense layer), loaded at 3 ranks under another plan, at 1 rank, and into the
unsharded single-process model; every load gives the state the 2-rank job had."""
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb.distributed import ShardingPlan, TableSharding, gather_full_state_dict, shard
from cachedemb.distributed.checkpoint import load_checkpoint, load_into_unsharded, load_plan, save_checkpoint
from cachedemb.distributed.testing import run_spawned


class _Model(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        adam = cachedemb.optim.Adam(lr=0.1)
        self.a = cachedemb.CachedEmbeddingBag(10, 3, mode="sum", cache_rows=2, optimizer=adam, device="cpu")
        self.b = cachedemb.CachedEmbeddingBag(7, 3, mode="sum", cache_rows=2, optimizer=adam, device="cpu")
        self.c = cachedemb.CachedEmbeddingBag(5, 3, mode="sum", cache_rows=2, optimizer=adam, device="cpu")
        self.dense = nn.Linear(3, 1)

    def forward(self, ids, offsets):
        return self.dense(self.a(ids, offsets) + self.b(ids % 7, offsets) + self.c(ids % 5, offsets))


def _plans(world: int) -> ShardingPlan:
    if world == 2:
        return ShardingPlan(2, {"a": TableSharding.row_wise(10, 2), "b": TableSharding.table_wise(7, 1, 2),
                                "c": TableSharding.data_parallel(5, 2)})
    if world == 3:
        return ShardingPlan(3, {"a": TableSharding.table_wise(10, 2, 3), "b": TableSharding.row_wise(7, 3),
                                "c": TableSharding.row_wise(5, 3)})
    return ShardingPlan(1, {name: TableSharding.table_wise(n, 0, 1) for name, n in (("a", 10), ("b", 7), ("c", 5))})


def _save_worker(rank: int, world: int, path: str):
    model = shard(_Model(seed=0), _plans(world))
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        g = torch.Generator().manual_seed(step * 10 + rank)
        ids = torch.randint(0, 10, (6,), generator=g)
        model(ids, torch.tensor([0, 2, 5])).sum().backward()
        sgd.step(), sgd.zero_grad()
    save_checkpoint(model, path)
    full = gather_full_state_dict(model)
    if rank == 0:
        torch.save(full, f"{path}.expected.pt")


def _load_worker(rank: int, world: int, path: str):
    model = shard(_Model(seed=1), _plans(world))  # other initial values: the load must replace them all
    load_checkpoint(model, path)
    full = gather_full_state_dict(model)
    if rank == 0:
        expected = torch.load(f"{path}.expected.pt")
        assert sorted(full) == sorted(expected)
        for key, value in expected.items():
            torch.testing.assert_close(full[key], value, msg=lambda m, k=key: f"{k}: {m}")
    return str(model.plan)


def load_at_one_rank(rank: int, world: int, path: str):
    """Inside a larger job: rank 0 alone (a 1-rank process group) loads the checkpoint; world-size-1 plan."""
    import torch.distributed as dist

    if rank != 0:
        return None
    group = dist.new_group([0], use_local_synchronization=True)
    model = shard(_Model(seed=1), _plans(1), process_group=group)
    load_checkpoint(model, path)
    full = gather_full_state_dict(model)
    expected = torch.load(f"{path}.expected.pt")
    assert sorted(full) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, msg=lambda m, k=key: f"{k}: {m}")
    return model.plan.world_size


def check_unsharded_load(path: str) -> None:
    single = _Model(seed=1)
    load_into_unsharded(single, path)
    expected = torch.load(f"{path}.expected.pt")
    assert sorted(single.state_dict()) == sorted(expected)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(value, expected[key], msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
def test_save_at_two_ranks_load_at_three_one_and_unsharded(tmp_path):
    path = str(tmp_path / "ckpt")
    run_spawned(_save_worker, 2, path)
    assert load_plan(path) == _plans(2)
    assert "row_wise" in run_spawned(_load_worker, 3, path)[0]
    run_spawned(_load_worker, 1, path)
    check_unsharded_load(path)
