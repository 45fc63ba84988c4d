"""kernels/host_sgd.py: the C SGD row update gives the torch code's bits (gather, add_ with alpha, scatter) over
row widths, block sizes and learning rates, declines where it does not apply, and training a CPU cache with it
equals training with the torch code (the plain nn.EmbeddingBag comparison is in tests/test_training.py)."""
from __future__ import annotations

import importlib

import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.kernels import host_sgd

pytestmark = pytest.mark.skipif(host_sgd.NATIVE.get() is None or not host_sgd._fused_add(),
                                reason="C helpers off, or torch's CPU add is not fused: the torch code runs")


def _torch_sgd(rows, idx, g, alpha):
    w = rows.index_select(0, idx)
    w.add_(g, alpha=alpha)
    rows.index_copy_(0, idx, w)


@pytest.mark.parametrize("dim", [1, 3, 4, 7, 16, 64, 100, 128])
@pytest.mark.parametrize("n", [1, 9, 300])
def test_the_c_update_equals_the_torch_update(dim, n):
    g = torch.Generator().manual_seed(dim * 1000 + n)
    for lr in (0.1, 0.0123456, 3.3, 1e-7):
        rows = torch.randn(700, dim, generator=g) * torch.rand(700, 1, generator=g) * 10
        idx = torch.randperm(700, generator=g)[:n]
        grad = torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 100
        ref = rows.clone()
        _torch_sgd(ref, idx, grad, -lr)
        version = rows._version
        assert host_sgd.sgd_rows(rows, idx, grad, -lr)
        assert torch.equal(rows, ref), (dim, n, lr)
        assert rows._version > version  # autograd sees the in-place change as a torch op would show it


def test_declines_and_leaves_the_rows_alone():
    rows = torch.randn(20, 4)
    before = rows.clone()
    g = torch.randn(3, 4)
    assert not host_sgd.sgd_rows(rows.double(), torch.tensor([1, 2, 3]), g.double(), -0.1)  # not float32
    assert not host_sgd.sgd_rows(rows.t(), torch.tensor([1, 2, 3]), torch.randn(3, 20), -0.1)  # not contiguous
    assert not host_sgd.sgd_rows(rows, torch.tensor([1, 2, 20]), g, -0.1)  # an index out of range
    assert not host_sgd.sgd_rows(rows, torch.tensor([1, -1, 3]), g, -0.1)
    assert torch.equal(rows, before)


@pytest.mark.parametrize("cache_rows", [5, 40, 400])
def test_training_with_the_c_update_equals_the_torch_update(cache_rows, monkeypatch):
    """Misses past a tiny cache are updated in the host table: both places take the C update."""
    def train(enabled):
        monkeypatch.setattr(host_sgd.NATIVE, "enabled", enabled)
        torch.manual_seed(0)
        emb = cachedemb.CachedEmbeddingBag(300, 8, mode="mean", cache_rows=cache_rows, device="cpu",
                                           optimizer=optim.SGD(lr=0.3))
        g = torch.Generator().manual_seed(1)
        for _ in range(12):
            ids = torch.randint(0, 300, (64,), generator=g)
            emb(ids, torch.arange(0, 64, 4)).pow(2).sum().backward()
        return emb.state_dict()["weight"]

    assert torch.equal(train(True), train(False))


def test_the_fast_path_runs_in_training(monkeypatch):
    calls = []
    real = host_sgd.sgd_rows
    monkeypatch.setattr(host_sgd, "sgd_rows", lambda *a: calls.append(1) or real(*a))
    sparse_update = importlib.import_module("cachedemb.kernels.sparse_update")  # the module (the package exports the op)
    monkeypatch.setattr(sparse_update, "sgd_rows", host_sgd.sgd_rows)
    emb = cachedemb.CachedEmbeddingBag(100, 4, mode="sum", cache_rows=10, device="cpu", optimizer=optim.SGD(lr=0.1))
    emb(torch.arange(20), torch.tensor([0, 10])).sum().backward()
    assert calls
