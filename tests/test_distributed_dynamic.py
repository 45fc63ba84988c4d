"""Sharded dynamic tables (cachedemb.distributed.sharded_dynamic) on one spawned gloo job at world size 2.

Against a single-process DynamicEmbeddingBag trained on the concatenation of the ranks' batches (sum of the
ranks' losses): outputs every step and eval outputs after (sum with padding_idx + per-sample weights +
min_count 2 + ttl, mean with Adam, max with SGD; raw ids near +-2^62, negative ids; uneven local batches, one
rank empty on some steps), then the id-keyed state gathered over the ranks equals the single process's (ids,
counts, last seen, pending ids, steps exactly; rows and optimizer state to fp32 tolerance), each rank holds
only the ids it owns, and a fresh sharded model loaded from the single-process state gathers back to it.
Capacity eviction is per rank: each rank's rows stay within ceil(capacity / 2), and its state equals a
single-process table of that capacity trained on its own ids of the global batches. unadmitted="shared" is
refused, alone and in a collection (tests/test_distributed_dynamic_collection.py shards collections).

A second job: cachedemb.prefetch over the sharded tables (depth 2, horizon 3) against the same training without
it: outputs every step and the gathered state bit-equal, stats equal, two batches exchanged and remapped by
their owners ahead of each step, capacity eviction while batches are in flight, an eval forward inside the loop;
then a loop left early followed by a new loop and plain forwards, and the refusal of a forward of another batch.
"""
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb import DynamicIds
from cachedemb.distributed import gather_full_state_dict, load_full_state_dict, shard
from cachedemb.distributed.dynamic import owner_rank
from cachedemb.distributed.testing import run_spawned
from cachedemb.dynamic.embedding_bag import DynamicEmbeddingBag

D, STEPS, WORLD = 6, 7, 2
POOL = torch.tensor([2**62 + k * 2**32 for k in range(10)] + [-(2**62) - k for k in range(10)]
                    + [k * 7919 for k in range(20)], dtype=torch.int64)
PAD = int(POOL[5])
TABLES = {  # name: (mode, optimizer, DynamicIds, padding_idx, per-sample weights)
    "s": ("sum", lambda: cachedemb.optim.Adagrad(lr=0.3), DynamicIds(capacity=64, min_count=2, ttl_steps=3, seed=3),
          PAD, True),
    "m": ("mean", lambda: cachedemb.optim.Adam(lr=0.1), DynamicIds(capacity=64, seed=4), None, False),
    "x": ("max", lambda: cachedemb.optim.SGD(lr=0.5), DynamicIds(capacity=64, on_full="evict_lru"), None, False),
}


def _bag(name, mode, optimizer, cfg, padding_idx, cache_rows=8):
    return _reference(DynamicEmbeddingBag(None, D, device="cpu", mode=mode, optimizer=optimizer(), dynamic=cfg,
                                          padding_idx=padding_idx, cache_rows=cache_rows))


def _reference(module):
    """The single-process references run inside the job (shard() builds its own per-rank modules)."""
    module.inner._shard_local = True
    return module


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleDict({n: _bag(n, mode, opt, cfg, pad) for n, (mode, opt, cfg, pad, _) in TABLES.items()})

    def forward(self, batch):
        return {n: self.tables[n](*batch[n]) for n in TABLES}


def _global_batch(step: int, name: str, psw: bool):
    """[sizes per rank], ids, offsets, lengths, per-sample weights, loss weights for the global batch."""
    g = torch.Generator().manual_seed(1000 * step + ord(name))
    sizes = [0 if step % 3 == 1 else 1 + step % 3, 2 + step % 2]
    lengths = torch.randint(0, 5, (sum(sizes),), generator=g)
    ids = POOL[torch.randint(0, POOL.numel(), (int(lengths.sum()),), generator=g)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    weights = torch.rand(ids.numel(), generator=g) if psw else None
    return sizes, ids, offsets, lengths, weights, torch.randn(sum(sizes), D, generator=g)


def _local(batch, rank: int):
    sizes, ids, offsets, lengths, weights, target = batch
    b0, b1 = sum(sizes[:rank]), sum(sizes[:rank + 1])
    i0, i1 = int(lengths[:b0].sum()), int(lengths[:b1].sum())
    args = (ids[i0:i1], offsets[b0:b1] - i0) + ((weights[i0:i1],) if weights is not None else ())
    return args, target[b0:b1], (b0, b1)


def _compare_states(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), f"{where}: keys {sorted(set(got) ^ set(want))} differ"
    for key, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} {key}: {m}")
        else:
            assert torch.equal(got[key], value), f"{where} {key}: {got[key].tolist()} != {value.tolist()}"


def _job(rank: int, world: int):
    torch.manual_seed(0)
    ref, model = Model(), shard(Model())
    batches = [{n: _global_batch(step, n, TABLES[n][4]) for n in TABLES} for step in range(STEPS)]
    for step, batch in enumerate(batches):
        local = {n: _local(b, rank) for n, b in batch.items()}
        out = model({n: args for n, (args, _, _) in local.items()})
        sum(((out[n] * target).sum() for n, (_, target, _) in local.items()), torch.zeros(())).backward()
        ref_in = {n: (b[1], b[2]) + ((b[4],) if b[4] is not None else ()) for n, b in batch.items()}
        ref_out = ref(ref_in)
        sum((ref_out[n] * b[5]).sum() for n, b in batch.items()).backward()
        for n, (_, _, (b0, b1)) in local.items():
            torch.testing.assert_close(out[n], ref_out[n][b0:b1], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step} table {n} rank {rank}: {m}")
    # Eval: read-only, same outputs.
    model.eval(), ref.eval()
    before = {n: model.module.tables[n].dynamic_stats()["ids_seen"] for n in TABLES}
    with torch.no_grad():
        local = {n: _local(b, rank) for n, b in batches[2].items()}
        out = model({n: args for n, (args, _, _) in local.items()})
        ref_out = ref({n: (b[1], b[2]) + ((b[4],) if b[4] is not None else ()) for n, b in batches[2].items()})
    for n, (_, _, (b0, b1)) in local.items():
        torch.testing.assert_close(out[n], ref_out[n][b0:b1], rtol=1e-5, atol=1e-6)
        assert model.module.tables[n].dynamic_stats()["ids_seen"] == before[n], f"eval forward of {n} counted ids"
    # Each rank holds only its own ids; both hold some.
    mine = model.state_dict()
    for n in TABLES:
        for key in ("module.tables.%s.ids" % n, "module.tables.%s.pending_ids" % n):
            assert bool((owner_rank(mine[key], world) == rank).all()), f"rank {rank} holds ids it does not own ({key})"
        assert mine[f"module.tables.{n}.ids"].numel() > 0, f"rank {rank} owns no admitted id of {n}"
    want = {k: v for k, v in ref.state_dict().items()}
    full = gather_full_state_dict(model)
    if rank == 0:
        _compare_states(full, want, "gathered vs single-process")
        assert want["tables.s.pending_ids"].numel() > 0 and want["tables.s.counts"].numel() > 0
    # A fresh sharded model loaded from the single-process state gathers back to it.
    fresh = shard(Model())
    load_full_state_dict(fresh, want)
    again = gather_full_state_dict(fresh)
    if rank == 0:
        _compare_states(again, want, "loaded then gathered")

    # Capacity eviction is per rank: rows <= ceil(8 / 2); equal to a single-process table of capacity 4 trained
    # on this rank's ids of the global batches (sum pooling, loss linear in the output: rows' gradients do not
    # depend on other rows).
    cfg = DynamicIds(capacity=8, on_full="evict_lfu", seed=9)
    small = shard(DynamicEmbeddingBag(None, D, device="cpu", mode="sum", optimizer=cachedemb.optim.Adagrad(lr=0.2),
                                      dynamic=cfg,
                                      cache_rows=4))
    alone = _reference(DynamicEmbeddingBag(None, D, device="cpu", mode="sum", optimizer=cachedemb.optim.Adagrad(lr=0.2),
                                           dynamic=DynamicIds(capacity=4, on_full="evict_lfu", seed=9), cache_rows=4))
    for step in range(STEPS):
        sizes, ids, offsets, lengths, _, target = _global_batch(step, "e", False)
        (args, local_target, _) = _local((sizes, ids, offsets, lengths, None, target), rank)
        (small(*args) * local_target).sum().backward()
        stats = small.module.dynamic_stats()
        assert stats["rows_in_use"] <= 4, f"rank {rank} step {step}: {stats['rows_in_use']} rows > capacity 4"
        keep = owner_rank(ids, world) == rank
        bag_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        own_offsets = torch.cat([torch.zeros(1, dtype=torch.int64),
                                 torch.bincount(bag_of[keep], minlength=lengths.numel()).cumsum(0)[:-1]])
        (alone(ids[keep], own_offsets) * target).sum().backward()
    assert small.module.dynamic_stats()["evicted"] > 0, f"rank {rank}: no capacity eviction happened"
    _compare_states(small.state_dict(), {"module." + k: v for k, v in alone.state_dict().items()},
                    f"rank {rank} capacity 4 vs its own ids alone")

    # Refusals, named.
    shared = DynamicEmbeddingBag(None, D, device="cpu", mode="sum", optimizer=cachedemb.optim.SGD(lr=0.1),
                                 dynamic=DynamicIds(capacity=8, unadmitted="shared"))
    with pytest.raises(NotImplementedError, match="unadmitted='shared'"):
        shard(shared)
    coll = cachedemb.CachedEmbeddingBagCollection(  # inside a collection too
        [cachedemb.TableConfig("users", None, D, ["u"], dynamic=DynamicIds(capacity=8, unadmitted="shared"))],
        device="cpu", cache_rows=4, optimizer=cachedemb.optim.SGD(lr=0.1))
    with pytest.raises(NotImplementedError, match="unadmitted='shared'"):
        shard(coll)
    return True


def test_sharded_dynamic_equals_single_process_world2():
    assert run_spawned(_job, WORLD, timeout_s=60) == [True] * WORLD


# ----------------------------------------------------------------- prefetch
PF_STEPS = 6
PF_TABLES = {  # sum with padding, per-sample weights, min_count 2, ttl; max with capacity eviction (held rows)
    "s": TABLES["s"],
    "e": ("max", lambda: cachedemb.optim.Adagrad(lr=0.2), DynamicIds(capacity=10, on_full="evict_lru", seed=6),
          None, False),
}


class PrefetchModel(nn.Module):
    """Dynamic tables with the prefetch protocol a user model defines for its batches."""

    def __init__(self):
        super().__init__()
        # 32 cache rows (16 a rank): a window of two batches fits, so every batch is served by one.
        self.tables = nn.ModuleDict({n: _bag(n, mode, opt, cfg, pad, cache_rows=32)
                                     for n, (mode, opt, cfg, pad, _) in PF_TABLES.items()})

    def forward(self, batch):
        return {n: self.tables[n](*args) for n, (args, _) in batch.items()}

    def prefetch_targets(self, batch):
        return [t for n, (args, _) in batch.items() for t in self.tables[n].prefetch_targets(args)]


def _pf_batches(rank: int) -> list[dict]:
    return [{n: _local(_global_batch(10 + step, n, PF_TABLES[n][4]), rank)[:2] for n in PF_TABLES}
            for step in range(PF_STEPS)]


def _pf_train(model, batches, it, log):
    for batch in it:
        out = model(batch)
        sum(((out[n] * target).sum() for n, (_, target) in batch.items()), torch.zeros(())).backward()
        log.append({n: o.detach().clone() for n, o in out.items()})
        if len(log) == 3:  # an eval forward inside the loop: exchanges its own batch, takes nothing queued
            with torch.no_grad():
                model({n: (args, None) for n, (args, _) in batches[0].items()})
        yield {n: (len(model.module.tables[n]._prefetched), len(model.module.tables[n].shard.ahead))
               for n in PF_TABLES}


def _prefetch_job(rank: int, world: int):
    batches = _pf_batches(rank)
    runs = {}
    for use_prefetch in (False, True):
        torch.manual_seed(0)
        model = shard(PrefetchModel())
        it = cachedemb.prefetch(batches, [model], depth=2, horizon=3) if use_prefetch else batches
        log = []
        queued = list(_pf_train(model, batches, it, log))
        runs[use_prefetch] = (log, gather_full_state_dict(model), model)
        if use_prefetch:
            # While batch i trains, the read-ahead distance (horizon + 2 x depth) of batches after it are
            # exchanged and remapped by their owners, fewer near the end.
            ahead = [min(it.read_ahead, PF_STEPS - 1 - i) for i in range(PF_STEPS)]
            assert it.read_ahead == 3 + 2 * 2
            assert [q["s"] for q in queued] == [(a, a) for a in ahead], (rank, queued)
            assert sum(it.window_batches) == PF_STEPS, it.window_batches
    (off_log, off_state, off_model), (on_log, on_state, on_model) = runs[False], runs[True]
    for step, (a, b) in enumerate(zip(off_log, on_log)):
        for n in PF_TABLES:
            torch.testing.assert_close(b[n], a[n], atol=0, rtol=0, msg=lambda m: f"step {step} {n} rank {rank}: {m}")
    for n in PF_TABLES:  # the eval forward saw the admissions of batches read ahead: its lookups aside
        on_stats, off_stats = on_model.module.tables[n].dynamic_stats(), off_model.module.tables[n].dynamic_stats()
        on_stats.pop("unadmitted_lookups"), off_stats.pop("unadmitted_lookups")
        assert on_stats == off_stats, (n, rank, on_stats, off_stats)
    assert on_model.module.tables["e"].dynamic_stats()["evicted"] > 0, "no capacity eviction under prefetch"
    if rank == 0:
        _compare_states(on_state, off_state, "prefetch on vs off")
        for key, value in off_state.items():  # bit-equal, not only close
            assert torch.equal(on_state[key], value), key

    # A loop left early: its exchanges are dropped (its read-ahead batches stay counted, as in one process), a
    # new loop and plain training forwards go on, in step on both ranks.
    torch.manual_seed(0)
    model = shard(PrefetchModel())
    for i, batch in enumerate(cachedemb.prefetch(batches, [model], depth=2, horizon=3)):
        model(batch)["s"].sum().backward()
        if i == 1:
            break
    for batch in cachedemb.prefetch(batches[2:4], [model], depth=2, horizon=3):
        model(batch)["s"].sum().backward()
    assert all(len(model.module.tables[n]._prefetched) == 0 for n in PF_TABLES)
    out = model(batches[4])
    sum(o.sum() for o in out.values()).backward()
    assert all(bool(torch.isfinite(o).all()) for o in out.values())
    # A training forward of another batch than the one read ahead is refused (it would desynchronize ranks).
    it = iter(cachedemb.prefetch(batches, [model], depth=2, horizon=3))
    next(it)
    with pytest.raises(RuntimeError, match="another batch than the one read ahead"):
        model(batches[1])
    it.close()
    return True


def test_sharded_dynamic_prefetch_on_vs_off_world2():
    assert run_spawned(_prefetch_job, WORLD, timeout_s=60) == [True] * WORLD
