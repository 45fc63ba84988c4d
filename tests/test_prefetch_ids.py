"""Which ids the pipeline reads for which module: a default extraction that cannot tell tables apart is refused at
the first batch (with the `ids=` to pass), a module that cannot be prefetched is refused when `prefetch()` is
called, and a forward whose ids were not the ones read ahead for it warns once, naming the module, in both sizing
modes, while training stays exact."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cachedemb
from cachedemb import optim
from cachedemb.prefetch import PrefetchIdsWarning

pytestmark = pytest.mark.usefixtures("sizing_mode")

N, D, BAGS, LEN = 3000, 8, 64, 4


def two_tables(seed=0):
    torch.manual_seed(seed)
    wa, wb = torch.randn(N, D), torch.randn(N, D)
    make = [lambda w=w: cachedemb.CachedEmbeddingBag(N, D, mode="sum", cache_rows=400, optimizer=optim.SGD(lr=0.1),
                                                     _weight=w.clone()) for w in (wa, wb)]
    return make[0](), make[1]()


def batches(steps=12):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ia = (torch.rand(BAGS * LEN, generator=g) ** 3 * N).long()
        ib = (N - 1 - (torch.rand(BAGS * LEN, generator=g) ** 3 * N)).long()  # other rows than table a's
        out.append((ia, ib, torch.arange(0, BAGS * LEN, LEN), torch.randn(BAGS, D, generator=g)))
    return out


def train(a, b, loader):
    outs = []
    for ia, ib, offsets, y in loader:
        oa, ob = a(ia, offsets), b(ib, offsets)
        ((oa + ob) * y).sum().backward()
        outs.append((oa.detach(), ob.detach()))
    return outs


def test_two_tables_in_one_batch_are_refused_without_ids():
    a, b = two_tables()
    before = a.cache_stats()["rows_in"], b.cache_stats()["rows_in"]
    with pytest.raises(ValueError, match=r"ids=lambda batch: \[batch\[0\], batch\[1\]\]") as error:
        train(a, b, cachedemb.prefetch(batches(), [a, b]))
    assert "modules[0]" in str(error.value) and "modules[1]" in str(error.value)
    assert (a.cache_stats()["rows_in"], b.cache_stats()["rows_in"]) == before  # nothing was admitted
    assert getattr(a.cache, "prefetch_owner", None) is None and getattr(b.cache, "prefetch_owner", None) is None
    with pytest.raises(ValueError, match=r"batch\['ids_0'\], batch\['ids_1'\]"):  # a dict batch: keys to pick
        list(cachedemb.prefetch([{"x": torch.arange(4), "y": torch.arange(4)}], [a, b]))


def test_a_module_without_a_cache_is_refused_when_prefetch_is_called():
    a, _ = two_tables()
    plain = nn.EmbeddingBag(10, 4)
    with pytest.raises(TypeError, match=r"modules\[1\] \(EmbeddingBag\(10, 4, mode='mean'\)\)"):
        cachedemb.prefetch(batches(), [a, plain])
    with pytest.raises(TypeError, match="ids must be a function"):
        cachedemb.prefetch(batches(), [a], ids=[0])


def test_a_batch_without_ids_says_how_to_pass_them():
    a, _ = two_tables()
    with pytest.raises(TypeError, match=r"'input' key, or give prefetch\(ids=lambda batch"):
        list(cachedemb.prefetch([{"x": torch.arange(4)}], [a]))


def test_ids_that_differ_from_the_forwards_warn_once_and_train_exactly():
    a0, b0 = two_tables()
    want = train(a0, b0, batches())
    a, b = two_tables()
    with pytest.warns(PrefetchIdsWarning, match=r"modules\[1\] \(CachedEmbeddingBag\(3000, 8") as seen:
        got = train(a, b, cachedemb.prefetch(batches(), [a, b], ids=lambda batch: [batch[0], batch[0]]))
    assert len([w for w in seen if w.category is PrefetchIdsWarning]) == 1  # once, for table b only
    for (wa, wb), (ga, gb) in zip(want, got):
        assert torch.equal(wa, ga) and torch.equal(wb, gb)
    assert torch.equal(a0.weight, a.weight) and torch.equal(b0.weight, b.weight)
    wrong = b.cache_stats()["rows_in"] + b.cache_stats()["host_rows"]
    a2, b2 = two_tables()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrefetchIdsWarning)  # the right ids: no warning
        got = train(a2, b2, cachedemb.prefetch(batches(), [a2, b2], ids=lambda batch: [batch[0], batch[1]]))
    for (wa, wb), (ga, gb) in zip(want, got):
        assert torch.equal(wa, ga) and torch.equal(wb, gb)
    assert b2.cache_stats()["rows_in"] + b2.cache_stats()["host_rows"] < wrong
    with warnings.catch_warnings():  # a module warns once per process, not once per loop
        warnings.simplefilter("error", PrefetchIdsWarning)
        train(a, b, cachedemb.prefetch(batches(), [a, b], ids=lambda batch: [batch[0], batch[0]]))


def test_a_loop_left_early_still_checks_its_forwards():
    a, b = two_tables()
    with pytest.warns(PrefetchIdsWarning, match=r"modules\[1\]"):
        for i, (ia, ib, offsets, y) in enumerate(cachedemb.prefetch(batches(), [a, b],
                                                                    ids=lambda batch: [batch[0], batch[0]])):
            ((a(ia, offsets) + b(ib, offsets)) * y).sum().backward()
            if i == 1:
                break
