"""The backward groups each id's lookups with the sort unique_ids already did (BatchPlan.groups), not a second
sort of the inverse: the grouping equals `lookup_groups`' (so the results are the same bits), and neither the
fused update nor the optimizer=None gradient calls `lookup_groups` during a step.

Checked against: torch.unique's outputs, a searchsorted of the stably sorted inverse (the grouping's
definition), and the same training run with the plan's groups dropped (the backward then sorts again).
"""
import importlib
import os

import pytest
import torch

import cachedemb
from cachedemb import kernels

bag_backward = importlib.import_module("cachedemb.kernels.bag_backward")  # the module (kernels.bag_backward is the op)

BACKENDS = ["torch", "triton"] if os.environ.get("TRITON_INTERPRET", "0") == "1" else ["torch"]


def groups_by_definition(inverse):
    """Stable sort of the inverse (padding last), group starts by a searchsorted."""
    n = inverse.numel()
    key = torch.where(inverse >= 0, inverse, torch.full_like(inverse, n))
    sorted_key, perm = torch.sort(key, stable=True)
    return perm, torch.searchsorted(sorted_key, torch.arange(n + 1))


def adversarial_ids(n, pad_id, seed):
    """Zipf-like repeats, multiples of 2^32, the padding id inside runs, and a batch's largest id last."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (n,), generator=g) * (1 << 32) + torch.randint(0, 3, (n,), generator=g)
    if pad_id is not None:
        ids[torch.rand(n, generator=g) < 0.3] = pad_id
    return ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pad_id", [None, 0, 1 << 32, 6 * (1 << 32) + 2])
@pytest.mark.parametrize("n", [0, 1, 37, 300])
def test_unique_ids_groups_match_definition(monkeypatch, backend, pad_id, n):
    monkeypatch.setenv("CACHEDEMB_BACKEND", backend)
    ids = adversarial_ids(n, pad_id, seed=n)
    uniq, inverse, counts, n_uniq, (perm, ptr) = kernels.unique_ids(ids, pad_id, return_groups=True)
    ref = kernels.unique_ids_torch(ids, pad_id)  # torch.unique, no groups
    for got, want in zip((uniq, inverse, counts, n_uniq), ref):
        assert torch.equal(got, want)
    ref_perm, ref_ptr = groups_by_definition(inverse)
    assert torch.equal(perm, ref_perm) and torch.equal(ptr, ref_ptr)
    fallback_perm, fallback_ptr = bag_backward.lookup_groups(inverse)
    assert torch.equal(fallback_perm, ref_perm) and torch.equal(fallback_ptr, ref_ptr)


def batches(steps, num, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(0, 5, (12,), generator=g)
        ids = (torch.rand(int(lengths.sum()), generator=g) ** 3 * num).to(torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)[:-1]])
        yield ids, offsets, torch.randn(12, 4, generator=g)


def train(optimizer, mode, steps):
    """A few steps through a small cache (misses, host-served rows, padding); the table afterwards."""
    torch.manual_seed(0)
    # optimizer=None: the dense gradient is the one built from the per-id sums (the sparse one is nn's, per lookup)
    emb = cachedemb.CachedEmbeddingBag(60, 4, mode=mode, cache_rows=8, padding_idx=2, optimizer=optimizer,
                                       sparse=False, device="cpu")
    sgd = torch.optim.SGD(emb.parameters(), lr=0.5) if optimizer is None else None
    for ids, offsets, target in batches(steps, 60):
        if sgd is not None:
            sgd.zero_grad()
        (emb(ids, offsets) * target).sum().backward()
        if sgd is not None:
            sgd.step()
    return emb.weight.detach().clone()


def train_counting(monkeypatch, optimizer, mode, steps, drop_groups):
    """`train`, counting the backward's calls of lookup_groups; with `drop_groups` the plans carry no groups."""
    calls = []
    real_groups = bag_backward.lookup_groups
    real_prepare = cachedemb.cache.embedding_cache.EmbeddingCache.prepare

    def counted(inverse):
        calls.append(inverse.numel())
        return real_groups(inverse)

    def prepare_without_groups(self, *args, **kwargs):
        plan = real_prepare(self, *args, **kwargs)
        plan.groups = None
        return plan

    with monkeypatch.context() as m:
        m.setattr(bag_backward, "lookup_groups", counted)
        if drop_groups:
            m.setattr(cachedemb.cache.embedding_cache.EmbeddingCache, "prepare", prepare_without_groups)
        weight = train(optimizer, mode, steps)
    return weight, calls


# The Triton cases run under the interpreter (seconds a step): one pooling mode each, three steps.
CASES = [("torch", "sum", True, 6), ("torch", "mean", True, 6)]
if "triton" in BACKENDS:
    CASES += [("triton", "mean", True, 3), ("triton", "sum", False, 3)]


@pytest.mark.usefixtures("sizing_mode")
@pytest.mark.parametrize("backend, mode, fused, steps", CASES,
                         ids=[f"{b}-{m}-{'fused_adagrad' if f else 'optimizer_none'}" for b, m, f, _ in CASES])
def test_backward_uses_plan_groups(monkeypatch, backend, mode, fused, steps):
    monkeypatch.setenv("CACHEDEMB_BACKEND", backend)
    make = (lambda: cachedemb.optim.Adagrad(lr=0.3)) if fused else (lambda: None)
    with_groups, calls = train_counting(monkeypatch, make(), mode, steps, drop_groups=False)
    assert calls == []  # the backward never sorted the inverse again
    without, calls = train_counting(monkeypatch, make(), mode, steps, drop_groups=True)
    assert len(calls) == steps  # the fallback, seen by the counter: one sort per backward
    assert torch.equal(with_groups, without)
