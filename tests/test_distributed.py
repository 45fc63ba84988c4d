"""Sharded CachedEmbeddingBag on spawned gloo ranks (world size 2 and 3) against the single-process module
trained on the concatenation of the ranks' batches: outputs every step, then the gathered table and optimizer
state (fp32 tolerance). Local batch sizes differ per rank and step; one rank has an empty batch at every step."""
import pytest
import torch

import cachedemb
from cachedemb.distributed import TableSharding, gather_full_state_dict, shard
from cachedemb.distributed.testing import run_spawned

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


def _all_cases(rank: int, world: int, kind: str, cases):
    return [_train_and_compare(rank, world, kind, mode, opt) for mode, opt in cases]


CASES = [("sum", "sgd"), ("mean", "adagrad"), ("max", "rowwise_adagrad"), ("sum", "adam"), ("mean", "adam"),
         ("max", "sgd")]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "data_parallel"])
def test_sharded_training_equals_single_process(world, kind):
    plans = run_spawned(_all_cases, world, kind, CASES)
    assert kind in plans[0][0]
