"""cachedemb.prefetch under abuse: a loop left by `break` mid-window or by an exception, a source that raises, an
eval loop nested in training, a second prefetcher over the same module (refused), a cache barely larger than one
batch with duplicate-heavy ids. The table always equals training the same batches without prefetch (a lockstep
module on the plain per-batch path), and no window protection, ownership or planned window leaks into the next
loop. Both sizing rules; windows planned ahead (overlap) on, as on CUDA."""
from __future__ import annotations

import pytest
import torch

import cachedemb

pytestmark = [pytest.mark.usefixtures("sizing_mode")]

NUM, DIM = 40, 4


def make(cache_rows=6, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(NUM, DIM)
    return cachedemb.CachedEmbeddingBag(NUM, DIM, mode="sum", cache_rows=cache_rows, device="cpu", _weight=w.clone(),
                                        optimizer=cachedemb.optim.Adagrad(lr=0.1))


def batches(count, seed=1, pool=12, lookups=8):
    """Duplicate-heavy batches: `lookups` ids drawn from a rotating pool of `pool` ids, two bags each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        base = (i * 5) % NUM
        ids = (base + torch.randint(0, pool, (lookups,), generator=g)) % NUM
        out.append((ids, torch.tensor([0, lookups // 3])))
    return out


def step(m, batch):
    ids, offsets = batch
    m(ids, offsets).pow(2).sum().backward()


def reference(trained, cache_rows=6):
    """The table after training `trained` batches in order, without prefetch."""
    ref = make(cache_rows)
    for b in trained:
        step(ref, b)
    return ref.weight.detach().clone()


def assert_no_leftovers(m):
    cache = m.cache
    assert not bool(cache.protected.any()), "window protection leaked out of the loop"
    assert cache._pending is None and cache.window_forwards_left == 0
    assert getattr(cache, "prefetch_owner", None) is None


def pf(source, m, **kw):
    kw.setdefault("depth", 3)
    kw.setdefault("horizon", 6)
    kw.setdefault("overlap", True)
    return cachedemb.prefetch(source, [m], **kw)


def test_break_mid_window_then_train_on(sizing_mode):
    data = batches(10)
    m = make()
    for i, b in enumerate(pf(data[:9], m)):
        step(m, b)
        if i == 4:  # inside the second window (depth 3), with the third one planned ahead
            break
    assert_no_leftovers(m)
    for b in pf(data[5:], m):
        step(m, b)
    assert_no_leftovers(m)
    torch.testing.assert_close(m.weight, reference(data), rtol=1e-6, atol=1e-6)


def _train_until_error(m, data, fail_at):
    for i, b in enumerate(pf(data, m)):
        ids, offsets = b
        out = m(ids, offsets)
        if i == fail_at:
            raise KeyError("loss went NaN")  # between forward and backward: this batch never trains
        out.pow(2).sum().backward()


def test_exception_in_the_loop_body(sizing_mode):
    data = batches(9)
    m = make()
    with pytest.raises(KeyError, match="NaN"):
        _train_until_error(m, data, fail_at=4)
    assert_no_leftovers(m)
    for b in pf(data[5:], m):
        step(m, b)
    torch.testing.assert_close(m.weight, reference(data[:4] + data[5:]), rtol=1e-6, atol=1e-6)


def test_source_that_raises(sizing_mode):
    data = batches(12)

    def source():
        yield from data[:6]
        raise OSError("disk read failed")

    m = make()
    yielded = []
    with pytest.raises(OSError, match="disk read"):
        for b in pf(source(), m, horizon=4):
            yielded.append(b)
            step(m, b)
    # Read-ahead meets the error 4 batches early; every batch handed out was trained, nothing else.
    assert 1 <= len(yielded) <= 6
    assert_no_leftovers(m)
    for b in pf(data[6:9], m):
        step(m, b)
    torch.testing.assert_close(m.weight, reference(yielded + data[6:9]), rtol=1e-6, atol=1e-6)


def test_eval_loop_nested_in_training(sizing_mode):
    data, held_out = batches(8), batches(3, seed=9, pool=30)
    m, ref = make(), make()
    for i, b in enumerate(pf(data, m)):
        step(m, b)
        step(ref, b)
        if i % 3 == 1:  # an eval pass over other ids, mid-window
            m.eval()
            ref.eval()
            with torch.no_grad():
                for ids, offsets in held_out:
                    torch.testing.assert_close(m(ids, offsets), ref(ids, offsets), rtol=1e-6, atol=1e-6)
            m.train()
            ref.train()
    assert_no_leftovers(m)
    torch.testing.assert_close(m.weight, ref.weight, rtol=1e-6, atol=1e-6)


def test_second_prefetcher_over_the_same_module_is_refused(sizing_mode):
    data = batches(7)
    m = make()
    for i, b in enumerate(pf(data, m)):
        step(m, b)
        if i == 2:
            protected = m.cache.protected.clone()
            with pytest.raises(RuntimeError, match="already used by another prefetch loop"):
                for _ in pf(batches(3, seed=5), m):
                    pass
            assert torch.equal(m.cache.protected, protected), "the refused loop touched the running window"
    assert_no_leftovers(m)
    torch.testing.assert_close(m.weight, reference(data), rtol=1e-6, atol=1e-6)
    # Once the first loop ended, another one is welcome.
    more = batches(3, seed=6)
    for b in pf(more, m):
        step(m, b)
    torch.testing.assert_close(m.weight, reference(data + more), rtol=1e-6, atol=1e-6)


def test_kept_iterator_blocks_until_closed(sizing_mode):
    data = batches(6)
    m = make()
    it = iter(pf(data, m))
    step(m, next(it))
    with pytest.raises(RuntimeError, match="close"):
        next(iter(pf(data, m)))
    it.close()
    assert_no_leftovers(m)
    for b in pf(data[1:], m):
        step(m, b)
    torch.testing.assert_close(m.weight, reference(data), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("depth", [1, 4])
def test_cache_barely_larger_than_a_batch(sizing_mode, depth):
    # 8 lookups from a pool of 5 ids: at most 5 distinct per batch, a cache of 6 rows.
    data = batches(10, seed=3, pool=5, lookups=8)
    m = make(cache_rows=6)
    for b in pf(data, m, depth=depth, horizon=8):
        step(m, b)
    assert_no_leftovers(m)
    torch.testing.assert_close(m.weight, reference(data, cache_rows=6), rtol=1e-6, atol=1e-6)
    stats = m.cache_stats()
    assert stats["hits"] + stats["misses"] == stats["unique"]
