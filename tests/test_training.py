"""Training through a 0.5% cache equals full-table training for every fused optimizer (200+ Zipf steps)."""
import numpy as np
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb import optim

# Every test here runs under both sizing rules (see conftest.sizing_mode).
pytestmark = [pytest.mark.usefixtures("sizing_mode")]

NUM, DIM, STEPS, BAGS, BAG_LEN = 4000, 16, 200, 32, 6


def zipf_batches(seed, steps=None, num=NUM):
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, num + 1, dtype=np.float64)
    p = ranks**-1.05
    p /= p.sum()
    perm = rng.permutation(num)
    for _ in range(STEPS if steps is None else steps):
        lengths = rng.integers(0, BAG_LEN + 1, BAGS)
        ids = perm[rng.choice(num, size=int(lengths.sum()), p=p)]
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        yield torch.from_numpy(ids), torch.from_numpy(offsets), torch.randn(BAGS, DIM, generator=torch.Generator().manual_seed(int(lengths.sum())))


def loss_fn(out, target):
    """Bounded gradients, so 200 steps of any optimizer stay finite; still depends on the weights."""
    return (torch.tanh(out) * target).sum()


def sparsify_max_grad(ref, ids):
    """torch has no sparse gradient for max mode: make the dense one sparse over the batch's ids, which is
    the set of rows the fused optimizers update."""
    if ref.mode == "max":
        touched = torch.unique(ids)
        g = ref.weight.grad
        ref.weight.grad = torch.sparse_coo_tensor(touched.unsqueeze(0), g[touched], g.shape)


class RowWiseAdagradReference:
    """FBGEMM's row-wise Adagrad written out over a dense table (the reference for RowWiseAdagrad)."""

    def __init__(self, weight, lr, eps):
        self.weight, self.lr, self.eps = weight, lr, eps
        self.acc = torch.zeros(weight.shape[0], 1)

    def step(self, sparse_grad):
        g = sparse_grad.coalesce()
        idx, val = g.indices()[0], g.values()
        self.acc[idx] += val.pow(2).mean(1, keepdim=True)
        self.weight.data[idx] -= self.lr * val / (self.acc[idx].sqrt() + self.eps)


SPECS = {
    "sgd": (optim.SGD(lr=0.1), lambda p: torch.optim.SGD([p], lr=0.1)),
    "adagrad": (optim.Adagrad(lr=0.1, eps=1e-10, initial_accumulator_value=0.1),
                lambda p: torch.optim.Adagrad([p], lr=0.1, eps=1e-10, initial_accumulator_value=0.1)),
    "rowwise_adagrad": (optim.RowWiseAdagrad(lr=0.1, eps=1e-8), None),
    "adam": (optim.Adam(lr=0.01, betas=(0.9, 0.99), eps=1e-8),
             lambda p: torch.optim.SparseAdam([p], lr=0.01, betas=(0.9, 0.99), eps=1e-8)),
}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("name", list(SPECS))
def test_cached_training_equals_full_table(name, mode):
    spec, make_ref_opt = SPECS[name]
    torch.manual_seed(0)
    ref = nn.EmbeddingBag(NUM, DIM, mode=mode, sparse=mode != "max")
    ours = cachedemb.CachedEmbeddingBag(NUM, DIM, mode=mode, cache_ratio=0.005, optimizer=spec,
                                        _weight=ref.weight.detach().clone(), device="cpu")
    assert ours.cache.capacity == 20
    ref_opt = make_ref_opt(ref.weight) if make_ref_opt else RowWiseAdagradReference(ref.weight, 0.1, 1e-8)
    for ids, offsets, target in zipf_batches(seed=7):
        ref.weight.grad = None
        loss_fn(ref(ids, offsets), target).backward()
        sparsify_max_grad(ref, ids)
        if make_ref_opt:
            ref_opt.step()
        else:
            ref_opt.step(ref.weight.grad)
        loss_fn(ours(ids, offsets), target).backward()
    torch.testing.assert_close(ours.weight, ref.weight.detach(), rtol=1e-5, atol=1e-5)
    stats = ours.cache_stats()
    assert stats["evictions"] > 0 and stats["rows_out"] > 0, stats
    if name in ("adagrad", "adam"):
        sd = ours.state_dict()
        ref_state = ref_opt.state[ref.weight]
        key_map = {"adagrad": {"sum": "sum"}, "adam": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}[name]
        for ours_key, ref_key in key_map.items():
            torch.testing.assert_close(sd[f"optimizer.{ours_key}"], ref_state[ref_key].to_dense()
                                       if ref_state[ref_key].is_sparse else ref_state[ref_key],
                                       rtol=1e-5, atol=1e-6)


def test_spill_path_trains_exactly():
    """A cache of 2 rows: nearly every batch spills, and training still equals the full table."""
    torch.manual_seed(1)
    ref = nn.EmbeddingBag(300, 8, mode="sum", sparse=True)
    ours = cachedemb.CachedEmbeddingBag(300, 8, mode="sum", cache_rows=2, optimizer=optim.Adagrad(lr=0.05),
                                        _weight=ref.weight.detach().clone(), device="cpu")
    ref_opt = torch.optim.Adagrad([ref.weight], lr=0.05)
    for ids, offsets, target in zipf_batches(seed=3, steps=30, num=300):
        target = target[:, :8]
        ref_opt.zero_grad()
        (ref(ids, offsets) - target).pow(2).sum().backward()
        ref_opt.step()
        (ours(ids, offsets) - target).pow(2).sum().backward()
    torch.testing.assert_close(ours.weight, ref.weight.detach(), rtol=1e-5, atol=1e-5)
