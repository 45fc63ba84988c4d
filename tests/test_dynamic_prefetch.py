"""Dynamic ids under cachedemb.prefetch: the remap runs when a batch is read ahead; training is bit-equal to the
same module without prefetch while capacity and ttl eviction pick rows that batches in flight still read (those
rows are held, never reused, until the batch is done), including when spare rows run out (remap falls back to
the forward)."""
import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.dynamic.embedding_bag import DynamicEmbeddingBag, DynamicIds
from test_dynamic import DIM, batches


def make(cfg, in_flight_rows):
    return DynamicEmbeddingBag(None, DIM, device="cpu", mode="sum", dynamic=cfg, optimizer=optim.Adagrad(lr=0.1),
                               cache_rows=12,
                               padding_idx=-1, in_flight_rows=in_flight_rows)


def run(dyn, data, loader=None):
    outs, seen = [], {"held": 0, "ahead": 0}
    for ids, offsets, g in (loader if loader is not None else data):
        out = dyn(ids, offsets)
        outs.append(out)
        (out * g).sum().backward()
        seen["held"] = max(seen["held"], dyn.dynamic_stats()["held_rows"])
        seen["ahead"] = max(seen["ahead"], sum(rows is not None for _, rows, _ in dyn.ahead))
    return outs, seen


def data(steps=30):
    out = []
    for ids, offsets, g in batches(steps, seed=4, bags=4, per_bag=4):
        out.append((torch.where(torch.arange(ids.numel()) % 7 == 3, -1, ids), offsets, g))
    return out


@pytest.mark.parametrize("on_full,ttl,in_flight_rows,depth", [
    ("evict_lfu", None, None, 2), ("evict_lru", None, None, 3), ("evict_lru", 3, None, 2),
    ("evict_lfu", 2, 2, 2), ("evict_lru", None, 0, 4)])
def test_prefetch_on_off_bit_equal_under_eviction(on_full, ttl, in_flight_rows, depth):
    cfg = DynamicIds(capacity=9, min_count=1, ttl_steps=ttl, on_full=on_full, seed=2)
    batches_ = data()
    off, on = make(cfg, in_flight_rows), make(cfg, in_flight_rows)
    want, _ = run(off, batches_)
    got, seen = run(on, batches_, cachedemb.prefetch(batches_, [on], depth=depth, horizon=2 * depth))
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), step
    state_on, state_off = on.state_dict(), off.state_dict()
    for key, value in state_off.items():
        assert torch.equal(state_on[key], value), key
    assert on.dynamic_stats()["evicted"] > 10 and on.dynamic_stats() == off.dynamic_stats() | {
        "held_rows": on.dynamic_stats()["held_rows"]}
    if in_flight_rows == 0:
        assert seen == {"held": 0, "ahead": 0}  # no spare row: every remap waited for its forward
    elif in_flight_rows is None:
        assert seen["ahead"] >= depth and seen["held"] > 0  # remapped ahead; victims in flight were held
    else:
        assert seen["ahead"] >= 1  # 2 spare rows: remapped ahead at times, paused at others


def test_held_rows_are_not_reused_while_in_flight():
    """A victim row read by a queued batch keeps its id's values until that batch's forward has run."""
    cfg = DynamicIds(capacity=2, on_full="evict_lru")
    dyn = DynamicEmbeddingBag(None, DIM, device="cpu", mode="sum", dynamic=cfg, optimizer=optim.SGD(lr=0.5),
                              in_flight_rows=4)
    one = torch.tensor([0])
    first = [(torch.tensor([10]), one), (torch.tensor([20, 30]), one), (torch.tensor([10]), one)]
    for batch in first:
        dyn.prefetch_targets(batch)  # all remapped ahead: 10 evicted at step 2, 20 at step 3 (10 returns)
    row_10, row_20 = int(dyn.ahead[0][1][0]), int(dyn.ahead[1][1][0])
    assert dyn.held_rows.tolist() == [row_10, row_20] and dyn.held_until.tolist() == [1, 2]
    assert int(dyn.ahead[2][1][0]) != row_10  # the returning id got a fresh row
    out = dyn(*first[0])
    assert torch.equal(out[0], cachedemb.dynamic.embedding_bag.initial_rows(0, torch.tensor([10]), DIM)[0])
    out.sum().backward()
    dyn(*first[1]).sum().backward()  # batch 1 starts: batch 0 is done, its held row goes back
    assert dyn.held_rows.tolist() == [row_20] and dyn.n_free == 6 - 2 - 1
    out = dyn(*first[2])  # the returning id reads a never-seen id's row, not batch 0's trained one
    assert torch.equal(out[0], cachedemb.dynamic.embedding_bag.initial_rows(0, torch.tensor([10]), DIM)[0])


def test_abandoned_read_ahead_and_bad_in_flight_rows():
    cfg = DynamicIds(capacity=4)
    dyn = DynamicEmbeddingBag(None, DIM, device="cpu", mode="sum", dynamic=cfg, optimizer=optim.SGD(lr=0.1))
    dyn.prefetch_targets(torch.tensor([1, 2]))
    dyn(torch.tensor([3]), torch.tensor([0])).sum().backward()  # not the queued batch: the queue is dropped
    assert len(dyn.ahead) == 0 and dyn.step == 2 and dyn.dynamic_stats()["rows_in_use"] == 3
    with pytest.raises(ValueError, match="in_flight_rows must be an int >= 0.*got -1"):
        DynamicEmbeddingBag(None, DIM, device="cpu", dynamic=cfg, optimizer=optim.SGD(lr=0.1), in_flight_rows=-1)

