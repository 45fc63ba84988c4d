"""Dynamic ids (cachedemb.dynamic) against the dict reference (cachedemb.dynamic.naive) + a dense table trained by
the same fused optimizer: outputs and rows bit-equal over many steps."""
import io

import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.dynamic.embedding_bag import DynamicEmbeddingBag, DynamicIds, IdIndex, initial_rows, mix64
from cachedemb.dynamic.naive import (NaiveDynamicIds, PAD_ROW, UNADMITTED_ROW, initial_rows_reference,
                                     probe_reference)

OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.1),
    "adagrad": lambda: optim.Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: optim.Adam(lr=0.01),
}
DIM = 5
# Adversarial raw ids: multiples of 2^32, ids equal in their low 32 bits, extremes of int64, negatives.
POOL = ([k << 32 for k in range(1, 9)] + [(k << 40) | 7 for k in range(-4, 5)]
        + [2 ** 63 - 1, -2 ** 63, -1, 0, 3, 12345678901234])


class Reference:
    """NaiveDynamicIds + a dense CachedEmbeddingBag holding every admission in a fresh row."""

    def __init__(self, cfg, mode, optimizer, padding_idx=None, rows=2000, **kw):
        self.cfg, self.remap = cfg, NaiveDynamicIds(cfg, padding_idx)
        self.dense = cachedemb.CachedEmbeddingBag(rows, DIM, device="cpu", mode=mode, optimizer=optimizer,
                                                  cache_rows=rows,
                                                  padding_idx=PAD_ROW if padding_idx is not None else None,
                                                  _weight=torch.zeros(rows, DIM), **kw)

    def __call__(self, ids, offsets=None, train=True):
        rows = self.remap.remap(ids.reshape(-1).tolist(), train)
        with torch.no_grad():
            weight = self.dense.weight  # flushed; the next forward re-reads it
            for row, raw in self.remap.new_rows:
                weight[row] = initial_rows(self.cfg.seed, torch.tensor([raw]), DIM)[0]
            if self.cfg.unadmitted == "zero":
                weight[UNADMITTED_ROW] = 0
        self.dense.train(train)
        return self.dense(torch.tensor(rows).reshape(ids.shape), offsets)


def batches(steps, seed=0, pool=POOL, bags=4, per_bag=3):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(pool, dtype=torch.int64)
    weights = 1.0 / torch.arange(1, pool.numel() + 1, dtype=torch.float64)  # skewed: some ids recur often
    for _ in range(steps):
        n = bags * per_bag
        ids = pool[torch.multinomial(weights, n, replacement=True, generator=g)]
        yield ids, torch.arange(0, n, per_bag), torch.randn(bags, DIM, generator=g)


def row_of(dyn, raw):
    return dyn.cache.host_weight[int(dyn._find(torch.tensor([raw]))[0])]


def check_rows_equal(dyn, ref):
    dyn.flush()
    ref.dense.flush()
    admitted = ref.remap.admitted()
    assert dyn.dynamic_stats()["rows_in_use"] == len(admitted)
    for raw, ref_row in admitted.items():
        row = int(dyn._find(torch.tensor([raw]))[0])
        assert row >= 0, raw
        assert torch.equal(dyn.cache.host_weight[row], ref.dense.cache.host_weight[ref_row]), raw
        for name, state in dyn.cache.host_states.items():
            assert torch.equal(state[row], ref.dense.cache.host_states[name][ref_row]), (raw, name)


def train_both(cfg, opt_name, mode="sum", steps=40, padding_idx=None, cache_rows=4, eval_every=0, **kw):
    dyn = cachedemb.CachedEmbeddingBag(None, DIM, device="cpu", mode=mode, dynamic=cfg,
                                       optimizer=OPTIMIZERS[opt_name](),
                                       cache_rows=cache_rows, padding_idx=padding_idx, **kw)
    ref = Reference(cfg, mode, OPTIMIZERS[opt_name](), padding_idx=padding_idx, **kw)
    for step, (ids, offsets, g) in enumerate(batches(steps)):
        if padding_idx is not None:
            ids = torch.where(torch.arange(ids.numel()) % 5 == 1, padding_idx, ids)
        out, expected = dyn(ids, offsets), ref(ids, offsets)
        assert torch.equal(out, expected), step
        (out * g).sum().backward()
        (expected * g).sum().backward()
        if eval_every and step % eval_every == 0:
            dyn.eval()
            with torch.no_grad():
                assert torch.equal(dyn(ids, offsets), ref(ids, offsets, train=False))
            dyn.train()
    check_rows_equal(dyn, ref)
    return dyn, ref


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bit_equal_to_reference_with_eviction(opt_name, mode):
    cfg = DynamicIds(capacity=9, min_count=2, on_full="evict_lfu")
    dyn, _ = train_both(cfg, opt_name, mode, eval_every=7)
    stats = dyn.dynamic_stats()
    assert stats["evicted"] > 0 and stats["admitted"] > 9 and stats["unadmitted_lookups"] > 0


@pytest.mark.parametrize("on_full", ["evict_lfu", "evict_lru", "reject"])
@pytest.mark.parametrize("unadmitted", ["zero", "shared"])
def test_policies_and_unadmitted_rows(on_full, unadmitted):
    cfg = DynamicIds(capacity=7, min_count=1, on_full=on_full, unadmitted=unadmitted, seed=11)
    dyn, ref = train_both(cfg, "adagrad", "mean", steps=30, padding_idx=-1)
    if on_full == "reject":
        assert dyn.dynamic_stats()["rejected"] > 0 and dyn.dynamic_stats()["evicted"] == 0
    if unadmitted == "shared":
        dyn.flush()
        ref.dense.flush()
        assert torch.equal(dyn.cache.host_weight[dyn.unadmitted_row], ref.dense.cache.host_weight[UNADMITTED_ROW])


def test_ttl_sweeps_bit_equal():
    cfg = DynamicIds(capacity=12, min_count=1, ttl_steps=3, on_full="evict_lru")
    dyn, _ = train_both(cfg, "adam", "sum", steps=40)
    assert dyn.dynamic_stats()["evicted"] > 0


def test_admission_at_exactly_min_count():
    dyn = DynamicEmbeddingBag(None, DIM, device="cpu", mode="sum", dynamic=DynamicIds(capacity=4, min_count=3),
                              optimizer=optim.SGD(lr=0.0))
    x = 2 ** 50 + 3
    ids = torch.tensor([x])
    for _ in range(2):
        assert torch.equal(dyn(ids, torch.tensor([0])), torch.zeros(1, DIM))
    out = dyn(ids, torch.tensor([0]))  # the 3rd occurrence: admitted, and this forward uses the row
    assert torch.equal(out[0], initial_rows(0, ids, DIM)[0])
    # Two occurrences in one batch count twice.
    y = -(2 ** 45)
    out = dyn(torch.tensor([y, y, y]), torch.tensor([0]))
    assert torch.equal(out[0], initial_rows(0, torch.tensor([y]), DIM)[0] * 3)
    stats = dyn.dynamic_stats()
    assert (stats["admitted"], stats["unadmitted_lookups"], stats["rows_in_use"]) == (2, 2, 2)


def test_eval_is_read_only():
    dyn = DynamicEmbeddingBag(None, DIM, device="cpu", mode="sum", dynamic=DynamicIds(capacity=4, min_count=1),
                              optimizer=optim.SGD(lr=0.1))
    ids, offsets = torch.tensor([5, 6]), torch.tensor([0, 1])
    dyn.eval()
    assert torch.equal(dyn(ids, offsets), torch.zeros(2, DIM))
    dyn.train()
    with torch.no_grad():
        dyn(ids, offsets)
    assert dyn.dynamic_stats()["ids_seen"] == 0 and dyn.step == 0 and dyn.index.live == 0
    dyn(ids, offsets)
    assert dyn.dynamic_stats()["rows_in_use"] == 2 and dyn.step == 1


def test_capacity_boundary_and_deterministic_victims():
    cfg = DynamicIds(capacity=3, on_full="evict_lfu")
    dyn = DynamicEmbeddingBag(None, DIM, device="cpu", mode="sum", dynamic=cfg, optimizer=optim.SGD(lr=0.1))
    one = torch.tensor([0])
    for raw, times in ((10, 3), (-20, 1), (30, 1)):  # counts 3, 1, 1; -20 and 30 tie on count, -20 older
        for _ in range(times):
            dyn(torch.tensor([raw]), one).sum().backward()
    assert dyn.dynamic_stats()["rows_in_use"] == 3 and dyn.dynamic_stats()["evicted"] == 0
    dyn(torch.tensor([40]), one).sum().backward()  # full: evicts -20 (count 1, last seen earliest)
    assert int(dyn._find(torch.tensor([-20]))[0]) == -1
    assert all(int(r) >= 0 for r in dyn._find(torch.tensor([10, 30, 40])))


def test_returning_id_is_a_never_seen_id():
    cfg = DynamicIds(capacity=2, on_full="evict_lru")
    opt = optim.Adam(lr=0.1)
    dyn = DynamicEmbeddingBag(None, DIM, device="cpu", mode="sum", dynamic=cfg, optimizer=opt, cache_rows=2)
    one = torch.tensor([0])
    x = 7 << 32
    for _ in range(3):
        dyn(torch.tensor([x]), one).sum().backward()  # trained, resident and dirty in the cache
    assert not torch.equal(dyn(torch.tensor([x]), one)[0], initial_rows(0, torch.tensor([x]), DIM)[0])
    dyn(torch.tensor([1, 2]), one).sum().backward()  # x evicted; its row reused while still cached
    out = dyn(torch.tensor([x]), one)
    assert torch.equal(out[0], initial_rows(0, torch.tensor([x]), DIM)[0])
    dyn.flush()
    row = int(dyn._find(torch.tensor([x]))[0])
    for name, state in dyn.cache.host_states.items():
        assert torch.equal(state[row], torch.zeros_like(state[row])), name


def test_initial_rows_are_a_function_of_seed_and_id():
    ids = torch.tensor(POOL)
    rows = initial_rows(3, ids, 7)
    perm = torch.randperm(ids.numel())
    assert torch.equal(initial_rows(3, ids[perm], 7), rows[perm])
    assert not torch.equal(initial_rows(4, ids, 7), rows)
    big = initial_rows(0, torch.arange(20000), 8)
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1) < 0.02


@pytest.mark.parametrize("dim", [1, 2, 5, 8, 64, 65])
def test_initial_rows_bit_equal_to_reference(dim):
    """The in-place generator gives the reference formulation's bits: adversarial ids (multiples of 2^32, equal
    low 32 / 48 bits, int64 extremes, sign flips), a dense run, random int64s; several seeds; odd dims and row
    counts, so vectorized loops run their tails."""
    g = torch.Generator().manual_seed(dim)
    k = torch.arange(-3000, 3001, dtype=torch.int64)
    ids = torch.cat([torch.tensor(POOL), k << 32, (k << 48) | 0x1234, (k << 32) | 0xFFFFFFFF, -k, k - 2 ** 63,
                     2 ** 63 - 1 - k.abs(), torch.arange(10_001),
                     torch.randint(-2 ** 63, 2 ** 63 - 1, (20_003,), generator=g, dtype=torch.int64)])
    ids = ids[: max(3001, 1_200_000 // dim)]
    for seed in (0, -1, 2 ** 62 + 5):
        for dtype in (torch.float32, torch.float64):
            got, want = initial_rows(seed, ids, dim, dtype), initial_rows_reference(seed, ids, dim, dtype)
            assert got.dtype == want.dtype == dtype and got.shape == want.shape == (ids.numel(), dim)
            same = got.reshape(-1).view(torch.int32 if dtype == torch.float32 else torch.int64) == \
                want.reshape(-1).view(torch.int32 if dtype == torch.float32 else torch.int64)
            assert bool(same.all()), (seed, dtype, torch.nonzero(~same)[:5].reshape(-1).tolist())
    for n in (0, 1, 3, 17):  # small row counts: no vectorized body at all
        assert torch.equal(initial_rows(7, ids[:n], dim), initial_rows_reference(7, ids[:n], dim))


def _mix64_python(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_mix64_matches_uint64_arithmetic():
    got = mix64(torch.tensor(POOL, dtype=torch.int64))
    assert [v & ((1 << 64) - 1) for v in got.tolist()] == [_mix64_python(v) for v in POOL]


@pytest.mark.parametrize("family", ["multiples_of_2_32", "equal_low_bits", "multiples_of_table_size"])
def test_index_probes_bounded_on_adversarial_ids(family):
    n = 50_000
    k = torch.arange(1, n + 1, dtype=torch.int64)
    keys = {"multiples_of_2_32": k << 32, "equal_low_bits": (k << 33) | 0x5A5A,
            "multiples_of_table_size": k * (1 << 17)}[family]
    index = IdIndex(size=1024)
    for chunk in keys.split(4096):
        index.insert(chunk[index.lookup(chunk) < 0])
    assert index.live == n and index.max_disp <= 32
    slots = index.lookup(keys)
    assert bool((slots >= 0).all()) and torch.equal(index.keys[slots], keys)
    assert bool((index.lookup(keys + 1) < 0).all())
    index.remove(slots[::2])
    assert bool((index.lookup(keys[::2]) < 0).all()) and bool((index.lookup(keys[1::2]) >= 0).all())


@pytest.mark.parametrize("size", [16, 64, 4096])
def test_index_slots_equal_scalar_reference(size):
    """IdIndex's vectorised rounds place every key where the scalar rounds do (probe_reference): same slots,
    tables, displacement; with tombstones, keys racing for one slot in a round, keys sharing a home slot."""
    g = torch.Generator().manual_seed(size)
    index = IdIndex(size=size, max_probe=64)
    k = torch.arange(1, 400, dtype=torch.int64)
    pool = torch.cat([k << 32, (k << 40) | 7, torch.randint(-2 ** 63, 2 ** 63 - 1, (400,), generator=g)])
    inserts = 0
    for step in range(30):
        keys = pool[torch.randint(0, pool.numel(), (int(torch.randint(1, size // 3, (1,), generator=g)),),
                                  generator=g)].unique()
        keys = keys[torch.randperm(keys.numel(), generator=g)]  # not sorted: the earliest in `keys` wins
        index.reserve(keys.numel())  # may grow the table (rehash) before the reference copies it
        table, state = index.keys.tolist(), index.state.tolist()
        home = index.home(keys).tolist()
        found, placed = probe_reference(table, state, home, keys.tolist(), index.mask, index.max_probe)
        slots = index.lookup(keys)
        assert slots.tolist() == found, step
        new = slots < 0
        if bool(new.any()):
            version = index.version
            slots[new] = index.insert(keys[new])
            assert index.version == version, "insert grew the table: max_probe exceeded"
            assert slots.tolist() == placed and index.keys.tolist() == table and index.state.tolist() == state, step
            inserts += 1
        if step % 3 == 2:  # tombstones
            live = index.live_slots()
            index.remove(live[torch.randperm(live.numel(), generator=g)[: live.numel() // 3]])
    assert inserts >= 20 and index.max_disp >= 2, (inserts, index.max_disp)


@pytest.mark.parametrize("unadmitted", ["zero", "shared"])
def test_state_dict_round_trip_continues_bit_equal(unadmitted):
    cfg = DynamicIds(capacity=8, min_count=2, ttl_steps=5, unadmitted=unadmitted, seed=5)
    dyn, ref = train_both(cfg, "adam", "mean", steps=20, padding_idx=3)
    buf = io.BytesIO()
    torch.save(dyn.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert torch.equal(state["ids"], torch.sort(torch.tensor(list(ref.remap.admitted())))[0])
    assert int(state["step"]) == 20 and state["counts"].dtype == torch.int64
    fresh = cachedemb.CachedEmbeddingBag(None, DIM, device="cpu", mode="mean", dynamic=cfg,
                                         optimizer=optim.Adam(lr=0.01),
                                         cache_rows=3, padding_idx=3)
    fresh.load_state_dict(state)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, state[name]), name
    for step, (ids, offsets, g) in enumerate(batches(15, seed=1)):
        out, expected = fresh(ids, offsets), ref(ids, offsets)
        assert torch.equal(out, expected), step
        (out * g).sum().backward()
        (expected * g).sum().backward()
    check_rows_equal(fresh, ref)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_export_keyed_equals_eval_forward(mode):
    cfg = DynamicIds(capacity=8, min_count=2, unadmitted="shared")
    dyn, _ = train_both(cfg, "rowwise_adagrad", mode, steps=15, padding_idx=-1)
    keyed = dyn.export_keyed()
    dyn.eval()
    unknown = [2 ** 62 + 1, -5, 99]
    ids = torch.tensor(POOL + unknown + [-1, POOL[0]])
    offsets = torch.tensor([0, 4, 9, 15, 20])
    with torch.no_grad():
        expected = dyn(ids, offsets)
        got = keyed(ids, offsets)
        # sum / max are bit-equal; mean divides in a different order in F.embedding_bag (last-bit differences).
        assert torch.equal(got, expected) if mode != "mean" else torch.allclose(got, expected, atol=1e-6, rtol=0)
    exported = torch.export.export(keyed, (ids, offsets))
    assert torch.allclose(exported.module()(ids, offsets), expected, atol=1e-6, rtol=0)


def test_optimizer_none_is_refused_naming_fused_optimizers():
    cfg = DynamicIds(capacity=4)
    with pytest.raises(ValueError, match=r"fused sparse optimizer \(optimizer=cachedemb.optim.SGD.*got optimizer=None"):
        DynamicEmbeddingBag(None, DIM, device="cpu", dynamic=cfg)
    with pytest.raises(ValueError, match="export_keyed"):
        cachedemb.CachedEmbeddingBag(None, DIM, device="cpu", dynamic=cfg, optimizer=None)
    from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection
    from cachedemb.collection.table_config import TableConfig
    with pytest.raises(ValueError, match="got optimizer=None"):
        CachedEmbeddingBagCollection([TableConfig("t", None, DIM, dynamic=cfg)], device="cpu")
