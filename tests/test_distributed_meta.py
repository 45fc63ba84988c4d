"""A model built on the meta device and sharded on spawned gloo ranks starts from exactly the values one process
gets from `cachedemb.materialize(model)` (the values of the model built on a real device), at world size 2 and
3, for row-wise, table-wise (ranks with no rows of a table) and data-parallel tables, a collection with the
default and a custom init_fn, and meta dense layers; every rank's generator ends where one process's does;
each rank allocates only its rows; and one training step then equals the one-process model's."""
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb.distributed import ShardingPlan, TableSharding, gather_full_state_dict, shard
from cachedemb.distributed.testing import run_spawned

TABLES = [cachedemb.TableConfig("ta", 23, 4, ["fa"]),
          cachedemb.TableConfig("tb", 17, 4, ["fb"], init_fn=nn.init.xavier_uniform_)]


class _Model(nn.Module):
    def __init__(self, device):
        super().__init__()
        opt = cachedemb.optim.Adagrad(lr=0.3)
        self.bottom = nn.Linear(3, 4, device=device)
        self.rows = cachedemb.CachedEmbeddingBag(41, 4, mode="sum", padding_idx=5, cache_rows=6, optimizer=opt,
                                                 device=device)
        self.small = cachedemb.CachedEmbeddingBag(9, 4, mode="sum", cache_rows=3, optimizer=opt, device=device)
        self.coll = cachedemb.CachedEmbeddingBagCollection(TABLES, device=device, cache_rows=5, optimizer=opt)
        self.top = nn.Linear(16, 1, device=device)

    def forward(self, dense, ids, offsets, feats):
        pooled = self.coll(feats)
        parts = [self.bottom(dense), self.rows(ids, offsets), self.small(ids % 9, offsets),
                 pooled["fa"] + pooled["fb"]]
        return self.top(torch.cat(parts, 1))


def _plan(world):
    last = world - 1
    return ShardingPlan(world, {"rows": TableSharding.row_wise(41, world),
                                "small": TableSharding.data_parallel(9, world),
                                "coll.ta": TableSharding.table_wise(23, last, world),
                                "coll.tb": TableSharding.row_wise(17, world)})


def _batch(rank_rows: range):
    g = torch.Generator().manual_seed(11)
    n = 6 * 3
    ids, dense = torch.randint(0, 41, (n * 2,), generator=g), torch.randn(n, 3, generator=g)
    fa, fb = torch.randint(0, 23, (n,), generator=g), torch.randint(0, 17, (n,), generator=g)
    bags = list(rank_rows)
    b0, b1 = bags[0], bags[-1] + 1
    steps = torch.arange(b0, b1 + 1)
    return (dense[b0:b1], ids[2 * b0:2 * b1], 2 * (steps - b0)[:-1],
            {"fa": (fa[b0:b1], steps - b0), "fb": (fb[b0:b1], steps - b0)})


def _reference():
    torch.manual_seed(7)
    built = _Model("cpu")  # built on a real device: what the meta model's plain tables and layers start from
    torch.manual_seed(7)
    materialized = cachedemb.materialize(_Model("meta"), "cpu")
    after = torch.rand(4)
    for m in [*built.modules(), *materialized.modules()]:  # one-process references inside a job of W ranks
        if isinstance(m, cachedemb.CachedEmbeddingBag):
            m._shard_local = True
    return built, after, materialized


def _worker(rank: int, world: int):
    built, after, reference = _reference()
    torch.manual_seed(7)
    sharded = shard(_Model("meta"), plan=_plan(world))
    assert torch.equal(torch.rand(4), after), rank  # every rank's generator where one process's is
    local = {name: m.shard.cache.host_weight.shape[0] if m.shard is not None else 0
             for name, m in sharded.sharded_modules().items()}
    lo, hi = TableSharding.row_wise(41, world).ranges[rank]
    assert local["rows"] == hi - lo, (rank, local)  # only its rows allocated
    assert local["small"] == 9  # data-parallel: every rank
    assert local["coll.embedding_bags.ta"] == (23 if rank == world - 1 else 0), local
    got_start = gather_full_state_dict(sharded)
    per_rank = 18 // world
    sharded(*_batch(range(rank * per_rank, (rank + 1) * per_rank))).square().sum().backward()
    got_trained = gather_full_state_dict(sharded)
    if rank == 0:
        start = {k: v.clone() for k, v in reference.state_dict().items()}
        # The meta model = the model built on a device, up to the collection (which, built on a device, draws
        # torchrec's normal_ before its init_fns; on meta only its reset_parameters() init_fns).
        for key in ("bottom.weight", "bottom.bias", "rows.weight", "small.weight"):
            assert torch.equal(built.state_dict()[key], start[key]), key
        reference(*_batch(range(0, 18))).square().sum().backward()
        trained = reference.state_dict()
        assert sorted(got_start) == sorted(start)
        for key in start:
            assert torch.equal(got_start[key], start[key]), key
            if key.startswith(("top.", "bottom.")):
                continue  # dense: DDP averages the ranks' gradients (torchrec's convention), not summed
            torch.testing.assert_close(got_trained[key], trained[key], rtol=1e-5, atol=1e-6, msg=key)
    return local


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_meta_model_sharded_starts_and_trains_as_one_process(world):
    locals_ = run_spawned(_worker, world, timeout_s=60.0)
    assert sum(loc["coll.embedding_bags.tb"] for loc in locals_) == 17  # row-wise: every row once
