"""Sharded CachedEmbeddingBag on spawned gloo ranks (world size 2 and 3) against the single-process module
trained on the concatenation of the ranks' batches: outputs every step, then the gathered table and optimizer
state (fp32 tolerance). Local batch sizes differ per rank and step; one rank has an empty batch at every step."""
import pytest
import torch

import cachedemb
from cachedemb.distributed import TableSharding, gather_full_state_dict, shard
from cachedemb.distributed.testing import run_spawned
from conftest import HAS_TORCHREC, needs_torchrec

N, D = 13, 4
OPTIMIZERS = {
    "sgd": lambda: cachedemb.optim.SGD(lr=0.5),
    "adagrad": lambda: cachedemb.optim.Adagrad(lr=0.3),
    "rowwise_adagrad": lambda: cachedemb.optim.RowWiseAdagrad(lr=0.3),
    "adam": lambda: cachedemb.optim.Adam(lr=0.1),
}


def _sizes(world: int, step: int) -> list[int]:
    """Local batch sizes (bags): rank 1 always empty, the others uneven and changing per step."""
    return [0 if r == 1 else 2 + (r + step) % 3 for r in range(world)]


def _global_batch(world: int, step: int, with_psw: bool):
    g = torch.Generator().manual_seed(100 + step)
    sizes = _sizes(world, step)
    lengths = torch.randint(0, 5, (sum(sizes),), generator=g)
    ids = torch.randint(0, N, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    psw = torch.rand(ids.numel(), generator=g) if with_psw else None
    target = torch.randn(sum(sizes), D, generator=g)
    return sizes, ids, offsets, lengths, psw, target


def _local(batch, rank: int):
    sizes, ids, offsets, lengths, psw, target = batch
    b0, b1 = sum(sizes[:rank]), sum(sizes[:rank + 1])
    i0, i1 = int(lengths[:b0].sum()), int(lengths[:b1].sum())
    local_offsets = offsets[b0:b1] - i0
    return ids[i0:i1], local_offsets, (psw[i0:i1] if psw is not None else None), target[b0:b1]


def _plan(kind: str, world: int) -> TableSharding:
    if kind == "table_wise":
        return TableSharding.table_wise(N, world % 2, world)  # rank 0 at 2 ranks; rank 1 (empty batch) at 3
    if kind == "row_wise":
        return TableSharding.row_wise(N, world)
    return TableSharding.data_parallel(N, world)


def _make(mode: str, opt: str, weight: torch.Tensor):
    module = cachedemb.CachedEmbeddingBag(N, D, mode=mode, cache_rows=3, optimizer=OPTIMIZERS[opt](), device="cpu",
                                          _weight=weight.clone(), padding_idx=2)
    module._shard_local = True  # the single-process reference (and the pre-shard warm-up) run in the job
    return module


def _train_and_compare(rank: int, world: int, kind: str, mode: str, opt: str, steps: int = 3):
    torch.manual_seed(0)
    weight = torch.randn(N, D)
    reference, module = _make(mode, opt, weight), _make(mode, opt, weight)
    warm = _global_batch(world, -1, False)
    for m in (reference, module):  # shard() must keep the module's current rows and optimizer state
        (m(warm[1], warm[2]) * warm[5]).sum().backward()
    model = shard(module, plan={"": _plan(kind, world)})
    with_psw = mode == "sum"
    for step in range(steps):
        batch = _global_batch(world, step, with_psw)
        ids, offsets, psw, target = _local(batch, rank)
        out = model(ids, offsets, psw)
        ref_out = reference(batch[1], batch[2], batch[4])
        b0 = sum(batch[0][:rank])
        torch.testing.assert_close(out, ref_out[b0:b0 + out.shape[0]], atol=1e-5, rtol=1e-5)
        (out * target).sum().backward()
        (ref_out * batch[5]).sum().backward()
    full = gather_full_state_dict(model)
    if rank == 0:
        expected = reference.state_dict()
        assert sorted(full) == sorted(expected), (sorted(full), sorted(expected))
        for key, value in expected.items():
            torch.testing.assert_close(full[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
        fresh = cachedemb.CachedEmbeddingBag(N, D, mode=mode, cache_rows=3, optimizer=OPTIMIZERS[opt](),
                                             device="cpu")
        fresh.load_state_dict(full)  # the single-process module loads the gathered state
    return str(model.plan)


def _all_cases(rank: int, world: int, kind: str, cases, steps: int = 3):
    return [_train_and_compare(rank, world, kind, mode, opt, steps) for mode, opt in cases]


CASES = [("sum", "sgd"), ("mean", "adagrad"), ("max", "rowwise_adagrad"), ("sum", "adam"), ("mean", "adam"),
         ("max", "sgd")]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "data_parallel"])
def test_sharded_training_equals_single_process(world, kind):
    plans = run_spawned(_all_cases, world, kind, CASES)
    assert kind in plans[0][0]


# ------------------------------------------------------------------------------------------------ fast jobs
# Spawning gloo ranks costs far more than the scenarios themselves (each process imports torch), so the
# non-slow tests run ONE job per world size that checks every scenario of the Tests bullet in turn;
# the per-scenario tests above and in tests/test_distributed_*.py are their slow, larger variants.
KINDS = ["table_wise", "row_wise", "data_parallel"]
MODES = ["sum", "mean", "max"]


def _every_kind_and_optimizer(rank: int, world: int) -> list[str]:
    """Every sharding type x every fused optimizer (pooling modes cycled), 2 steps each."""
    plans = []
    for k, kind in enumerate(KINDS):
        for o, opt in enumerate(OPTIMIZERS):
            plans.append(_train_and_compare(rank, world, kind, MODES[(k + o) % 3], opt, steps=2))
    return plans


def _unsharded_refuses(rank: int, world: int) -> str:
    """An unsharded cached module in this job refuses its first forward, naming shard(), before any change."""
    module = cachedemb.CachedEmbeddingBag(10, 2, cache_rows=2, device="cpu")
    host = module.cache.host_weight.clone()
    with pytest.raises(RuntimeError, match=f"cachedemb.distributed.shard.*{world} processes|"
                                           f"{world} processes.*cachedemb.distributed.shard") as info:
        module(torch.tensor([1, 2]), torch.tensor([0]))
    assert torch.equal(host, module.cache.host_weight)
    return str(info.value)


def _ddp_refused(rank: int, world: int) -> str:
    """DDP around a sharded model (or shard() of a DDP) is refused, naming what to do instead."""
    from torch import nn

    module = cachedemb.CachedEmbeddingBag(8, 2, mode="sum", cache_rows=2, device="cpu")
    dense = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="shard\\(\\) the plain model"):
        shard(nn.parallel.DistributedDataParallel(dense))
    model = shard(module, {"": TableSharding.row_wise(8, world)})
    with pytest.raises(TypeError, match="already wraps") as info:
        nn.parallel.DistributedDataParallel(model)
    return str(info.value)


def _job(rank: int, world: int, path: str) -> dict:
    import test_distributed_checkpoint as ckpt
    import test_distributed_collection as coll
    import test_distributed_model as dense
    import test_distributed_prefetch as pf

    out = {"kinds": _every_kind_and_optimizer(rank, world), "unsharded": _unsharded_refuses(rank, world),
           "ddp": _ddp_refused(rank, world)}
    if HAS_TORCHREC:  # the collection is fed KeyedJaggedTensors
        out["collection"] = coll._worker(rank, world, "adam", False) if world == 2 else \
            coll._worker(rank, world, "rowwise_adagrad", True)
    if world == 2:
        out["dense"] = dense._dense_model_worker(rank, world, True)
        out["prefetch"] = pf.prefetch_worker(rank, world)
        ckpt._save_worker(rank, world, path)
    else:
        out["load3"] = ckpt._load_worker(rank, world, path)
        out["load1"] = ckpt.load_at_one_rank(rank, world, path)
    return out


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    return run_spawned(_job, 2, path, timeout_s=120), path


@pytest.fixture(scope="module")
def job3(job2):
    return run_spawned(_job, 3, job2[1], timeout_s=120)


@pytest.mark.parametrize("world", [2, 3])
def test_every_sharding_type_and_fused_optimizer(world, job2, job3):
    """Uneven local batches, rank 1 empty at every step: outputs and gathered table + state equal the
    single-process module on the concatenated batches (asserted on the ranks; here the plans they ran)."""
    results = job2[0] if world == 2 else job3
    plans = results[0]["kinds"]
    assert len(plans) == 12 and all(kind in plans[4 * k] for k, kind in enumerate(KINDS))


@needs_torchrec
def test_collection_equals_single_process(job2, job3):
    assert "table_wise" in job2[0][0]["collection"] and "row_wise" in job3[0]["collection"]


def test_dense_model_under_ddp(job2):
    assert [r["dense"] for r in job2[0]] == [True, True]


def test_unsharded_module_and_ddp_around_a_sharded_model_refused(job2, job3):
    for results in (job2[0], job3):
        for r in results:
            assert "cachedemb.distributed.shard" in r["unsharded"]
            assert "shard()" in r["ddp"]


def test_prefetch_on_vs_off_identical(job2):
    import test_distributed_prefetch as pf

    pf.check_prefetch_results([r["prefetch"] for r in job2[0]])


def test_checkpoint_saved_at_two_loads_at_three_one_and_unsharded(job2, job3):
    import test_distributed_checkpoint as ckpt

    path = job2[1]
    assert ckpt.load_plan(path) == ckpt._plans(2)
    assert "row_wise" in job3[0]["load3"] and job3[0]["load1"] == 1
    ckpt.check_unsharded_load(path)
