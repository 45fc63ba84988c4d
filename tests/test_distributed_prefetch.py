"""cachedemb.prefetch on a sharded model: reading a batch ahead runs its input all-to-all, so each rank's horizon
and windows see the ids it owns; training through it equals training without it (outputs every step, the
gathered table and optimizer state), for a row-wise table and a table-wise/data-parallel collection (KJT).
The spawned job runs inside tests/test_distributed.py's merged jobs; `test_prefetch_on_vs_off` is its slow
standalone run."""
import pytest
import torch

import cachedemb
from cachedemb import CachedEmbeddingBagCollection, TableConfig
from cachedemb.distributed import ShardingPlan, TableSharding, gather_full_state_dict, shard
from cachedemb.distributed.testing import run_spawned
from conftest import HAS_TORCHREC

ROWS, DIM, STEPS = 40, 4, 5
TABLES = [TableConfig("t1", 30, 4, ("f1", "f2")), TableConfig("t2", 12, 4, ("f3",), pooling="mean")]


def _sizes(world: int, step: int) -> list[int]:
    """Rank 1's batch is empty every other step; the others uneven."""
    return [0 if r == 1 and step % 2 else 1 + (r + step) % 3 for r in range(world)]


def _bag_batches(rank: int, world: int) -> list[dict]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        b = _sizes(world, step)[rank]
        lengths = torch.randint(0, 4, (b,), generator=g)
        out.append({"input": torch.randint(0, ROWS, (int(lengths.sum()),), generator=g),
                    "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]),
                    "target": torch.randn(b, DIM, generator=g)})
    return out


def _kjt_batches(rank: int, world: int) -> list[tuple]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(7 + 1000 * step + rank)
        b = _sizes(world, step)[rank]
        values, lengths = [], []
        for rows in (30, 30, 12):
            lens = torch.randint(0, 3, (b,), generator=g)
            values.append(torch.randint(0, rows, (int(lens.sum()),), generator=g))
            lengths.append(lens)
        kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.cat(values), lengths=torch.cat(lengths),
                                stride=b)
        out.append((kjt, torch.randn(b, 12, generator=g)))
    return out


class _Collection(torch.nn.Module):
    """A model around a collection, with the prefetch protocol a user model defines for its batches."""

    def __init__(self):
        super().__init__()
        self.ebc = CachedEmbeddingBagCollection(TABLES, device="cpu", cache_rows=4,
                                                optimizer=cachedemb.optim.RowWiseAdagrad(lr=0.2))

    def forward(self, kjt):
        return self.ebc(kjt).values()

    def prefetch_targets(self, batch):
        return self.ebc.prefetch_targets(batch[0])


def _train(model, batches, use_prefetch: bool, forward, loss):
    it = cachedemb.prefetch(batches, [model], depth=2, horizon=3) if use_prefetch else batches
    outs, queued = [], []
    for batch in it:
        out = forward(model, batch)
        loss(out, batch).backward()
        outs.append(out.detach().clone())
        queued.append(sum(len(m._prefetched) for m in model.sharded_modules().values()))
    return outs, queued, it


def prefetch_worker(rank: int, world: int) -> dict:
    """Both models (a row-wise bag, a collection) trained with and without prefetch; compared on every rank."""
    seen = {}
    runs = {}
    for use_prefetch in (False, True):
        torch.manual_seed(0)
        bag = cachedemb.CachedEmbeddingBag(ROWS, DIM, mode="sum", cache_rows=16, device="cpu",
                                           optimizer=cachedemb.optim.Adam(lr=0.1))
        model = shard(bag, {"": TableSharding.row_wise(ROWS, world)})
        outs, queued, it = _train(model, _bag_batches(rank, world), use_prefetch,
                                  lambda m, b: m(b["input"], b["offsets"]), lambda o, b: (o * b["target"]).sum())
        runs[("bag", use_prefetch)] = (outs, gather_full_state_dict(model))
        if use_prefetch:
            seen["bag_queued"] = queued  # batches exchanged ahead while each forward ran
            seen["bag_windows"] = list(it.window_batches)
            seen["read_ahead"] = it.read_ahead
        if not HAS_TORCHREC:  # the collection's batches are KeyedJaggedTensors
            continue
        torch.manual_seed(0)
        plan = ShardingPlan(world, {"ebc.t1": TableSharding.table_wise(30, 0, world),
                                    "ebc.t2": TableSharding.data_parallel(12, world)})
        model = shard(_Collection(), plan)
        outs, queued, it = _train(model, _kjt_batches(rank, world), use_prefetch, lambda m, b: m(b[0]),
                                  lambda o, b: (o * b[1]).sum())
        runs[("collection", use_prefetch)] = (outs, gather_full_state_dict(model))
        if use_prefetch:
            seen["collection_queued"] = queued
    for name in ("bag", "collection") if HAS_TORCHREC else ("bag",):
        (off_outs, off_state), (on_outs, on_state) = runs[(name, False)], runs[(name, True)]
        for step, (a, b) in enumerate(zip(off_outs, on_outs)):
            torch.testing.assert_close(b, a, atol=0, rtol=0, msg=lambda m, s=step, n=name: f"{n} step {s}: {m}")
        if rank == 0:
            assert sorted(on_state) == sorted(off_state)
            for key, value in off_state.items():
                torch.testing.assert_close(on_state[key], value, atol=0, rtol=0,
                                           msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
    return seen


def check_prefetch_results(seen: list[dict]) -> None:
    for rank, s in enumerate(seen):
        # While batch i runs, the read-ahead distance (horizon + 2 x depth: the horizon of the window planned
        # furthest ahead) of batches after it were already exchanged, fewer near the end.
        assert s["read_ahead"] == 3 + 2 * 2, (rank, s)
        ahead = [min(s["read_ahead"], STEPS - 1 - i) for i in range(STEPS)]
        assert s["bag_queued"] == ahead, (rank, s)
        if HAS_TORCHREC:
            assert s["collection_queued"] == [2 * a for a in ahead], (rank, s)  # two tables, each its own exchange
        assert sum(s["bag_windows"]) == STEPS, (rank, s)  # every batch served by an admitted window


@pytest.mark.slow
def test_prefetch_on_vs_off():
    check_prefetch_results(run_spawned(prefetch_worker, 2))
