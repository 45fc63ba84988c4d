"""A CachedEmbeddingBagCollection with a dynamic (raw int64 id) table beside a plain one, sharded on one spawned
gloo job at world size 2: the dynamic table's ids go to their hash owners, the plain table row-wise by the plan.
Against the single-process collection trained on the concatenated batches (sum of the ranks' losses): outputs
every step, then the gathered state (keys as the collection's; ids, counts, steps exactly, rows and optimizer
state to fp32 tolerance); the same training under cachedemb.prefetch (depth 2, horizon 3) is bit-equal to it
without; the full state loads back into a fresh sharded collection; each rank holds only the ids it owns; a DCP
checkpoint written by the 2 ranks loads into a fresh sharded collection and into one process."""
import torch

import cachedemb
from cachedemb import CachedEmbeddingBagCollection, DynamicIds, TableConfig
from cachedemb.distributed import TableSharding, gather_full_state_dict, load_full_state_dict, shard
from cachedemb.distributed import checkpoint as dcp_checkpoint
from cachedemb.distributed.dynamic import owner_rank
from cachedemb.distributed.testing import run_spawned

STEPS = 5
RAW = torch.tensor([2**62 + k * 2**32 for k in range(8)] + [-(2**61) - 3 * k for k in range(8)], dtype=torch.int64)
TABLES = [TableConfig("plain", 13, 4, ["fp"]),
          TableConfig("dyn", None, 4, ["fd", "fe"], dynamic=DynamicIds(capacity=32, min_count=2, seed=5))]


def _collection():
    torch.manual_seed(0)
    ebc = CachedEmbeddingBagCollection(TABLES, device="cpu", cache_rows=4, optimizer=cachedemb.optim.Adagrad(lr=0.3))
    for bag in ebc.bags:  # one-process references inside a job of 2 ranks
        (bag.inner if hasattr(bag, "inner") else bag)._shard_local = True
    return ebc


def _batch(step: int):
    """Per feature (values, lengths) of the global batch; sizes per rank (rank 1 empty on step 2)."""
    g = torch.Generator().manual_seed(step)
    sizes = [3, 0 if step == 2 else 2]
    batch = {}
    for f in ("fp", "fd", "fe"):
        lengths = torch.randint(0, 4, (sum(sizes),), generator=g)
        n = int(lengths.sum())
        ids = torch.randint(0, 13, (n,), generator=g) if f == "fp" else RAW[torch.randint(0, 16, (n,), generator=g)]
        batch[f] = (ids, lengths)
    return sizes, batch, torch.randn(sum(sizes), 4, generator=g)


def _features(batch, b0: int, b1: int) -> dict:
    out = {}
    for f, (ids, lengths) in batch.items():
        i0, i1 = int(lengths[:b0].sum()), int(lengths[:b1].sum())
        out[f] = (ids[i0:i1], torch.cat([torch.zeros(1, dtype=torch.int64), lengths[b0:b1].cumsum(0)]))
    return out


def _loss(pooled: dict, target) -> torch.Tensor:
    return sum(((pooled[k] * target).sum() for k in ("fp", "fd", "fe")), torch.zeros(()))


def _train(model, rank: int, use_prefetch: bool) -> list:
    batches = [_batch(step) for step in range(STEPS)]
    local = []
    for sizes, batch, target in batches:
        b0, b1 = sum(sizes[:rank]), sum(sizes[:rank + 1])
        local.append((_features(batch, b0, b1), target[b0:b1]))
    outs = []
    stream = cachedemb.prefetch([f for f, _ in local], [model], depth=2, horizon=3) if use_prefetch else \
        (f for f, _ in local)
    for step, features in enumerate(stream):
        pooled = model(features)
        outs.append({k: v.detach().clone() for k, v in pooled.items()})
        _loss(pooled, local[step][1]).backward()
    return outs


def _plan(world):
    return {"plain": TableSharding.row_wise(13, world)}


def _job(rank: int, world: int, ckpt: str):
    reference, model = _collection(), shard(_collection(), plan=_plan(world))
    dyn = model.module.embedding_bags["dyn"]
    assert type(dyn).__name__ == "ShardedDynamicEmbeddingBag"
    outs = _train(model, rank, use_prefetch=False)
    for step, (sizes, batch, target) in enumerate(_batch(s) for s in range(STEPS)):
        ref = reference(_features(batch, 0, sum(sizes)))
        b0, b1 = sum(sizes[:rank]), sum(sizes[:rank + 1])
        for key in ("fp", "fd", "fe"):
            torch.testing.assert_close(outs[step][key], ref[key][b0:b1].detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key, s=step: f"step {s} {k}: {m}")
        _loss(ref, target).backward()
    mine = dyn.shard.state_dict()["ids"]
    assert mine.numel() > 0 and bool((owner_rank(mine, world) == rank).all())  # only the ids it owns
    assert dyn.shard.dynamic_stats()["rows_in_use"] == mine.numel() > 0  # admitted (min_count 2) and trained
    full = gather_full_state_dict(model)
    prefetched = shard(_collection(), plan=_plan(world))
    outs_p = _train(prefetched, rank, use_prefetch=True)
    assert prefetched.module.cache_stats()["windows"] > 0  # the pipeline did admit windows
    for a, b in zip(outs, outs_p):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    full_p = gather_full_state_dict(prefetched)
    if rank == 0:
        want = reference.state_dict()
        assert sorted(full) == sorted(want), sorted(set(full) ^ set(want))
        assert any(k.startswith("embedding_bags.dyn.") and k.endswith("ids") for k in want)
        for key, value in want.items():
            if value.is_floating_point():
                torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
            else:
                assert torch.equal(full[key], value), key
            assert torch.equal(full_p[key], full[key]), key  # prefetch on = off, bit for bit
    # The full state (every rank holds it) loads into a fresh sharded collection and gathers back.
    full = [full]
    torch.distributed.broadcast_object_list(full, src=0)
    fresh = shard(_collection(), plan=_plan(world))
    load_full_state_dict(fresh, full[0])
    again = gather_full_state_dict(fresh)
    if rank == 0:
        for key, value in full[0].items():
            assert torch.equal(again[key], value), key
    # A DCP checkpoint: every rank writes its ids' part; a fresh sharded model (and, in the test, one process)
    # loads all of it.
    dcp_checkpoint.save_checkpoint(model, ckpt)
    loaded = shard(_collection(), plan=_plan(world))
    dcp_checkpoint.load_checkpoint(loaded, ckpt)
    from_dcp = gather_full_state_dict(loaded)
    if rank == 0:
        for key, value in full[0].items():
            assert torch.equal(from_dcp[key], value), key
        torch.save(full[0], ckpt + ".full.pt")
    return True


def test_sharded_collection_with_a_dynamic_table_equals_single_process(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert run_spawned(_job, 2, ckpt, timeout_s=60.0) == [True, True]
    full = torch.load(ckpt + ".full.pt", weights_only=True)
    single = _collection()
    dcp_checkpoint.load_into_unsharded(single, ckpt)  # the world-2 checkpoint in one process
    state = single.state_dict()
    assert sorted(state) == sorted(full)
    for key, value in full.items():
        assert torch.equal(state[key], value), key
