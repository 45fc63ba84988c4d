"""Cache semantics: LFU choice against a brute-force model, stats arithmetic, dirty-only write-back, state_dict
round trips (also through a plain nn.EmbeddingBag), from_pretrained, warm-up, and bad input that changes nothing."""
import resource
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import cachedemb
from cachedemb import optim

# Every test here runs under both sizing rules (see conftest.sizing_mode).
pytestmark = [pytest.mark.usefixtures("sizing_mode")]


def resident(emb):
    ids = emb.cache.slot_ids[: emb.cache.capacity]
    return sorted(int(i) for i in ids if i >= 0)


def feed(emb, batch, train=True):
    ids = torch.tensor(batch, dtype=torch.int64)
    offsets = torch.tensor([0])
    if train:
        out = emb(ids, offsets)
        out.sum().backward()
        return out
    with torch.no_grad():
        return emb(ids, offsets)


class LFUModel:
    """Brute-force model of the documented rule: a batch's hits are protected; misses (ascending id) take
    empty slots first (lowest slot), then the lowest (count, slot); misses beyond the free slots are served
    without becoming resident. Counts persist per id."""

    def __init__(self, capacity):
        self.slots = [None] * capacity
        self.count = {}
        self.hits = self.misses = self.evictions = 0

    def batch(self, ids):
        uniq = sorted(set(ids))
        hits = {i for i in uniq if i in self.slots}
        misses = [i for i in uniq if i not in hits]
        self.hits += len(hits)
        self.misses += len(misses)
        free = [s for s, i in enumerate(self.slots) if i not in hits]
        free.sort(key=lambda s: (-1, s) if self.slots[s] is None else (self.count.get(self.slots[s], 0), s))
        for miss, slot in zip(misses, free):
            if self.slots[slot] is not None:
                self.evictions += 1
            self.slots[slot] = miss
        for i in ids:
            self.count[i] = self.count.get(i, 0) + 1

    def resident(self):
        return sorted(i for i in self.slots if i is not None)


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_lfu_matches_brute_force_model(capacity):
    gen = torch.Generator().manual_seed(capacity)
    emb = cachedemb.CachedEmbeddingBag(40, 4, mode="sum", cache_rows=capacity, optimizer=optim.SGD(0.1),
                                       device="cpu")
    model = LFUModel(capacity)
    for _ in range(60):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        # skewed ids so counts differ
        batch = [int(x) for x in (torch.rand(n, generator=gen) ** 3 * 40).long()]
        feed(emb, batch)
        model.batch(batch)
        assert resident(emb) == model.resident()
    stats = emb.cache_stats()
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (model.hits, model.misses, model.evictions)


def test_counts_persist_across_eviction():
    emb = cachedemb.CachedEmbeddingBag(10, 2, mode="sum", cache_rows=1, device="cpu")
    feed(emb, [5, 5, 5], train=True)
    feed(emb, [7], train=True)  # evicts 5 (only slot), 5's count goes to the host
    assert int(emb.cache.host_freq[5]) == 3
    feed(emb, [5], train=True)  # 5 comes back with its count
    slot = int((emb.cache.slot_ids == 5).nonzero()[0, 0])
    assert int(emb.cache.slot_freq[slot]) == 4


def test_counts_decay_with_a_halflife():
    emb = cachedemb.CachedEmbeddingBag(10, 2, mode="sum", cache_rows=1, device="cpu", freq_halflife=2)
    feed(emb, [5, 5, 5, 5])  # 5 counted 4 times
    feed(emb, [7])  # second training batch: every count halves (5 -> 2 on the host, 7 -> 0 in the cache)
    assert int(emb.cache.host_freq[5]) == 2
    slot = int((emb.cache.slot_ids == 7).nonzero()[0, 0])
    assert int(emb.cache.slot_freq[slot]) == 0
    with pytest.raises(ValueError, match="freq_halflife"):
        cachedemb.CachedEmbeddingBag(10, 2, cache_rows=1, device="cpu", freq_halflife=0)


def test_current_batch_rows_are_never_evicted():
    emb = cachedemb.CachedEmbeddingBag(20, 2, mode="sum", cache_rows=2, device="cpu")
    feed(emb, [1])
    feed(emb, [2, 2, 2, 2])
    # 1 is the least frequent resident row, but the batch uses it: 2 must be the victim.
    feed(emb, [1, 3])
    assert resident(emb) == [1, 3]


def test_stats_arithmetic_and_dirty_only_write_back():
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(50, 4, mode="mean", cache_rows=4, optimizer=optim.SGD(0.1),
                                       padding_idx=0, device="cpu")
    lookups = 0
    for step in range(30):
        ids = torch.randint(0, 50, (9,))
        lookups += int((ids != 0).sum())
        emb(ids, torch.tensor([0, 4])).sum().backward()
    s = emb.cache_stats()
    assert s["lookups"] == lookups
    assert s["hits"] + s["misses"] == s["unique"]
    # Misses beyond the free slots are served from the host table in place; the rest are moved in.
    assert s["rows_in"] + s["host_rows"] == s["misses"]
    assert s["evictions"] <= s["rows_in"]
    assert s["bytes_in"] == s["rows_in"] * (4 * 4 + 8)
    # Every admitted row was trained, so each eviction wrote one dirty row.
    assert 0 < s["rows_out"] <= s["rows_in"]
    emb.reset_cache_stats()
    host_before = emb.weight.clone()
    out_before = emb.cache_stats()["rows_out"]
    with torch.no_grad():
        for _ in range(10):
            emb(torch.randint(0, 50, (12,)), torch.tensor([0, 6]))
    emb.eval()
    emb(torch.randint(0, 50, (12,)), torch.tensor([0, 6]))  # eval with grad enabled, never backward-ed
    s = emb.cache_stats()
    assert s["misses"] > 0 and s["rows_out"] == out_before
    assert torch.equal(emb.weight, host_before)


def test_eval_does_not_count_frequencies():
    emb = cachedemb.CachedEmbeddingBag(10, 2, mode="sum", cache_rows=3, device="cpu")
    emb.eval()
    with torch.no_grad():
        emb(torch.tensor([1, 1, 2]), torch.tensor([0]))
    emb.flush()
    assert int(emb.cache.host_freq.sum()) == 0 and int(emb.cache.slot_freq.sum()) == 0


def _train(emb, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 60, (16,), generator=gen)
        (emb(ids, torch.tensor([0, 5, 11])).tanh().sum()).backward()


@pytest.mark.parametrize("spec", [optim.Adam(lr=0.01), optim.Adagrad(lr=0.1), optim.RowWiseAdagrad(lr=0.1)],
                         ids=lambda s: type(s).__name__)
def test_state_dict_round_trip_continues_identically(spec):
    torch.manual_seed(0)
    a = cachedemb.CachedEmbeddingBag(60, 5, mode="sum", cache_rows=4, optimizer=spec, device="cpu")
    _train(a, 10, seed=1)
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    assert sd["weight"].shape == (60, 5) and "optimizer.step" in sd
    b = cachedemb.CachedEmbeddingBag(60, 5, mode="sum", cache_rows=7, optimizer=spec, device="cpu")
    b.load_state_dict(sd)
    _train(a, 10, seed=2)
    _train(b, 10, seed=2)
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    for key, value in a.state_dict().items():
        torch.testing.assert_close(value, b.state_dict()[key], rtol=0, atol=0)


def test_state_dict_into_plain_embedding_bag_and_back():
    torch.manual_seed(0)
    ours = cachedemb.CachedEmbeddingBag(30, 3, mode="max", cache_rows=2, device="cpu")
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        ours(torch.randint(0, 30, (8,)), torch.tensor([0, 3])).sum().backward()
        opt.step()
    plain = nn.EmbeddingBag(30, 3, mode="max")
    plain.load_state_dict(ours.state_dict())  # strict: 'weight' is the only key
    ids, offsets = torch.randint(0, 30, (10,)), torch.tensor([0, 4])
    torch.testing.assert_close(plain(ids, offsets), ours(ids, offsets), rtol=0, atol=0)
    with torch.no_grad():
        plain.weight.mul_(2)
    back = cachedemb.CachedEmbeddingBag(30, 3, mode="max", cache_rows=5, device="cpu")
    back.load_state_dict(plain.state_dict())
    torch.testing.assert_close(back(ids, offsets), plain(ids, offsets), rtol=0, atol=0)
    # Loading also replaces rows that were already cached.
    ours.load_state_dict(plain.state_dict())
    torch.testing.assert_close(ours(ids, offsets), plain(ids, offsets), rtol=0, atol=0)


def test_load_state_dict_rejects_wrong_shape():
    emb = cachedemb.CachedEmbeddingBag(30, 3, cache_rows=2, device="cpu")
    with pytest.raises(RuntimeError, match="size mismatch"):
        emb.load_state_dict({"weight": torch.zeros(31, 3)})


def test_from_pretrained_keeps_row_order_and_freezes():
    table = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    emb = cachedemb.CachedEmbeddingBag.from_pretrained(table, mode="sum", cache_rows=3)
    ids, offsets = torch.tensor([19, 0, 7, 7, 3]), torch.tensor([0, 2])
    expected = nn.functional.embedding_bag(ids, table, offsets, mode="sum")
    # The cache lives on the default device (CUDA where there is one); the output comes from it.
    torch.testing.assert_close(emb(ids, offsets).cpu(), expected, rtol=0, atol=0)
    assert not any(p.requires_grad for p in emb.parameters())
    torch.testing.assert_close(emb.weight, table)
    with pytest.raises(ValueError, match="freeze=True"):
        cachedemb.CachedEmbeddingBag.from_pretrained(table, optimizer=optim.SGD(0.1))
    trainable = cachedemb.CachedEmbeddingBag.from_pretrained(table, freeze=False, mode="sum", cache_rows=3,
                                                             optimizer=optim.SGD(1.0))
    before = float(table[19, 0])
    trainable(ids, offsets).sum().backward()
    assert float(trainable.weight[19, 0]) == before - 1


def test_id_freq_warms_the_cache_with_the_hottest_rows():
    freq = torch.zeros(100, dtype=torch.int64)
    freq[[5, 50, 70, 99]] = torch.tensor([10, 40, 30, 20])
    emb = cachedemb.CachedEmbeddingBag(100, 2, cache_rows=4, id_freq=freq, warmup_ratio=0.75, device="cpu")
    assert resident(emb) == [50, 70, 99]
    with torch.no_grad():
        emb(torch.tensor([50, 70, 99]), torch.tensor([0]))
    assert emb.cache_stats()["hits"] == 3
    with pytest.raises(ValueError, match="id_freq"):
        cachedemb.CachedEmbeddingBag(100, 2, id_freq=torch.ones(99, dtype=torch.int64))


def snapshot(emb):
    c = emb.cache
    return [c.host_weight.clone(), c.host_freq.clone(), c.slot_ids.clone(), c.slot_freq.clone(), c.stats.clone(),
            c.rows.detach().clone(), c.dirty.clone(), torch.tensor(c.generation)]


BAD_INPUTS = [
    ("id_too_large", dict(input=torch.tensor([1, 30]), offsets=torch.tensor([0])), IndexError, r"30 at position 1.*\[0, 30\)"),
    ("negative_id", dict(input=torch.tensor([-2, 3]), offsets=torch.tensor([0])), IndexError, r"-2 at position 0"),
    ("float_ids", dict(input=torch.tensor([1.0, 2.0]), offsets=torch.tensor([0])), TypeError, "int32 or int64"),
    ("float_offsets", dict(input=torch.tensor([1, 2]), offsets=torch.tensor([0.0])), TypeError, "offsets"),
    ("offsets_not_zero", dict(input=torch.tensor([1, 2]), offsets=torch.tensor([1])), ValueError, r"offsets\[0\] must be 0"),
    ("offsets_decreasing", dict(input=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2, 1])), ValueError, "non-decreasing"),
    ("offsets_beyond", dict(input=torch.tensor([1, 2]), offsets=torch.tensor([0, 3])), ValueError, r"<= len\(input\)=2"),
    ("missing_offsets", dict(input=torch.tensor([1, 2]), offsets=None), ValueError, "offsets is required"),
    ("2d_with_offsets", dict(input=torch.tensor([[1, 2]]), offsets=torch.tensor([0])), ValueError, "2-D"),
    ("3d_input", dict(input=torch.zeros(1, 1, 1, dtype=torch.long), offsets=None), ValueError, "3-D"),
    ("psw_shape", dict(input=torch.tensor([1, 2]), offsets=torch.tensor([0]), per_sample_weights=torch.ones(3)), ValueError, r"shape \(2,\)"),
    ("psw_int", dict(input=torch.tensor([1, 2]), offsets=torch.tensor([0]), per_sample_weights=torch.ones(2, dtype=torch.long)), TypeError, "floating-point"),
]


@pytest.mark.parametrize("name,kwargs,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_and_changes_nothing(name, kwargs, exc, match):
    emb = cachedemb.CachedEmbeddingBag(30, 3, mode="sum", cache_rows=2, optimizer=optim.Adam(0.1), device="cpu")
    emb(torch.tensor([1, 2, 3]), torch.tensor([0])).sum().backward()
    before = snapshot(emb)
    with pytest.raises(exc, match=match):
        emb(**kwargs)
    for a, b in zip(before, snapshot(emb)):
        assert torch.equal(a, b)


def test_psw_with_non_sum_mode_is_rejected():
    emb = cachedemb.CachedEmbeddingBag(30, 3, mode="mean", cache_rows=2, device="cpu")
    with pytest.raises(ValueError, match="only supported for mode='sum'"):
        emb(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(max_norm=-1.0), ValueError, "max_norm"),
    (dict(norm_type="l2"), ValueError, "norm_type"),
    (dict(mode="median"), ValueError, "mode must be one of"),
    (dict(cache_ratio=0.0), ValueError, "cache_ratio"),
    (dict(cache_rows=0), ValueError, "cache_rows"),
    (dict(padding_idx=30), ValueError, "padding_idx"),
    (dict(optimizer=torch.optim.SGD), TypeError, "cachedemb.optim"),
    (dict(dtype=torch.int64), TypeError, "dtype"),
], ids=["max_norm", "norm_type", "mode", "cache_ratio", "cache_rows", "padding_idx", "torch_optim", "dtype"])
def test_constructor_rejects(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cachedemb.CachedEmbeddingBag(30, 3, device="cpu", **kwargs)


def test_backward_after_a_later_forward_is_refused():
    emb = cachedemb.CachedEmbeddingBag(30, 3, mode="sum", cache_rows=2, optimizer=optim.SGD(0.1), device="cpu")
    first = emb(torch.tensor([1, 2]), torch.tensor([0]))
    emb(torch.tensor([3, 4]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="later forward"):
        first.sum().backward()


def test_to_moves_only_the_cache():
    emb = cachedemb.CachedEmbeddingBag(30, 3, cache_rows=2, device="cpu")
    host = emb.cache.host_weight
    emb.to("cpu")
    assert emb.cache.host_weight is host
    with pytest.raises(TypeError, match="int64"):
        emb.to(torch.int64)
    if torch.cuda.is_available():
        emb.cuda()
        assert emb.cache.rows.device.type == "cuda" and emb.cache.host_weight.device.type == "cpu"


def test_construction_peak_host_memory_is_one_table():
    """Peak RSS while building a 2M x 64 table with Adagrad state stays <= 1.15 x (table + state)."""
    code = textwrap.dedent("""
        import resource, torch, cachedemb
        torch.zeros(1)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        emb = cachedemb.CachedEmbeddingBag(2_000_000, 64, cache_rows=1000, device="cpu",
                                           optimizer=cachedemb.optim.Adagrad(0.1))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((peak - base) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown = int(out.stdout.strip())
    table_and_state = 2_000_000 * 64 * 4 * 2 + 2_000_000 * 8  # weight + Adagrad sum + counts
    assert grown <= 1.15 * table_and_state, (grown, table_and_state)


@pytest.mark.parametrize("make,match", [
    (lambda: optim.SGD(lr=-0.1), "lr"),
    (lambda: optim.Adagrad(lr=0.1, eps=-1.0), "eps"),
    (lambda: optim.RowWiseAdagrad(initial_accumulator_value=-1.0), "initial_accumulator_value"),
    (lambda: optim.Adam(betas=(1.0, 0.9)), "betas"),
], ids=["sgd_lr", "adagrad_eps", "rowwise_init", "adam_betas"])
def test_optimizer_specs_reject_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def device_side_bytes(cache):
    tensors = [cache.rows.data, cache.slot_ids, cache.slot_freq, cache.slot_last_use, cache.dirty, cache.next_use,
               cache.protected, cache.index_keys, cache.index_slots, cache.stats, cache.history]
    tensors += list(cache.states.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def test_device_metadata_is_proportional_to_the_cache_not_the_table():
    small = cachedemb.CachedEmbeddingBag(1_000, 8, cache_rows=64, optimizer=optim.Adam(0.1), device="cpu")
    large = cachedemb.CachedEmbeddingBag(400_000, 8, cache_rows=64, optimizer=optim.Adam(0.1), device="cpu")
    assert device_side_bytes(small.cache) == device_side_bytes(large.cache)
    per_row = device_side_bytes(large.cache) / 64
    # rows + Adam moments (3 x 8 fp32) + ids/counts/last use/index/flags: ~140 bytes per cached row
    assert per_row < 8 * 4 * 3 + 64, per_row


def test_load_state_dict_reports_keys_it_does_not_own():
    trained = cachedemb.CachedEmbeddingBag(20, 3, cache_rows=2, optimizer=optim.Adam(0.1), device="cpu")
    plain = cachedemb.CachedEmbeddingBag(20, 3, cache_rows=2, device="cpu")
    result = plain.load_state_dict(trained.state_dict(), strict=False)
    assert sorted(result.unexpected_keys) == ["optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.step"]
    assert torch.equal(plain.weight, trained.weight)
    with pytest.raises(RuntimeError, match="junk"):
        plain.load_state_dict({"weight": torch.zeros(20, 3), "junk": torch.zeros(1)})


ERROR_CASES = {
    "id >= n": (dict(), lambda m: m(torch.tensor([1, 12]), torch.tensor([0]))),
    "id < 0": (dict(), lambda m: m(torch.tensor([1, -1]), torch.tensor([0]))),
    "offsets[0] != 0": (dict(), lambda m: m(torch.tensor([1, 2]), torch.tensor([1]))),
    "offsets past input": (dict(), lambda m: m(torch.tensor([1, 2]), torch.tensor([0, 3]))),
    "float ids": (dict(), lambda m: m(torch.tensor([1.0, 2.0]), torch.tensor([0]))),
    "psw outside sum": (dict(mode="mean"), lambda m: m(torch.tensor([1, 2]), torch.tensor([0]), torch.rand(2))),
    "psw dtype": (dict(), lambda m: m(torch.tensor([1, 2]), torch.tensor([0]), torch.rand(2, dtype=torch.float64))),
    "psw shape": (dict(), lambda m: m(torch.tensor([1, 2]), torch.tensor([0]), torch.rand(3))),
    "max with sparse": (dict(mode="max", sparse=True), lambda m: m(torch.tensor([1, 2]), torch.tensor([0]))),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_are_caught_by_embedding_bags_except_clauses(case):
    """Whatever nn.EmbeddingBag raises for a mistake, an `except` for that type catches ours too (and the
    message names the bad value)."""
    kwargs, call = ERROR_CASES[case]
    kwargs = {"mode": "sum", **kwargs}
    with pytest.raises(Exception) as theirs:
        call(nn.EmbeddingBag(10, 3, **kwargs))
    ours_module = cachedemb.CachedEmbeddingBag(10, 3, cache_rows=2, device="cpu", **kwargs)
    with pytest.raises(type(theirs.value)):
        call(ours_module)


def test_padding_idx_error_is_an_assertion_error_too():
    with pytest.raises(AssertionError):
        nn.EmbeddingBag(10, 3, padding_idx=12)
    with pytest.raises(AssertionError, match="12"):
        cachedemb.CachedEmbeddingBag(10, 3, padding_idx=12, device="cpu")
