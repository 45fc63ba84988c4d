"""Dynamic-id tables in CachedEmbeddingBagCollection (TableConfig(dynamic=...) / dynamic={name: ...}): each is
trained bit-equal to the dict reference (cachedemb.dynamic.naive + a dense table) fed the same raw ids, beside a
plain table that stays equal to a collection without the dynamic tables; state_dict round trip."""
import io

import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection
from cachedemb.dynamic.embedding_bag import DynamicIds
from cachedemb.collection.table_config import TableConfig
from conftest import needs_torchrec
from test_dynamic import DIM, POOL, Reference, check_rows_equal

USERS = DynamicIds(capacity=9, min_count=2, on_full="evict_lfu", seed=3)
CROSSES = DynamicIds(capacity=7, on_full="evict_lru", unadmitted="shared", ttl_steps=4)
B = 4


def make_tables(with_dynamic=True):
    tables = [TableConfig("goods", 20, DIM, ["i"], pooling="mean")]
    if with_dynamic:
        tables = [TableConfig("users", None, DIM, ["u"], dynamic=USERS),
                  tables[0],
                  TableConfig("crosses", 7, DIM, ["c1", "c2"], pooling="mean", dynamic=CROSSES)]
    return tables


def make_collection(with_dynamic=True, seed=0):
    torch.manual_seed(seed)
    return CachedEmbeddingBagCollection(make_tables(with_dynamic), device="cpu", cache_rows=4,
                                        optimizer=optim.Adagrad(lr=0.1))


def feature_batches(steps, seed):
    """Per step {feature: (values, offsets with the end)}: raw adversarial ids for u/c1/c2, [0, 20) for i."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(POOL, dtype=torch.int64)
    weights = 1.0 / torch.arange(1, pool.numel() + 1, dtype=torch.float64)
    for _ in range(steps):
        batch = {}
        for key in ("u", "i", "c1", "c2"):
            lengths = torch.randint(0, 4, (B,), generator=g)
            n = int(lengths.sum())
            if key == "i":
                values = torch.randint(0, 20, (n,), generator=g)
            else:
                values = pool[torch.multinomial(weights, max(n, 1), replacement=True, generator=g)][:n]
            batch[key] = (values, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
        yield batch


def as_kjt(batch):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(batch)
    values = torch.cat([batch[k][0] for k in keys])
    lengths = torch.cat([batch[k][1].diff() for k in keys])
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def lookup_major(batch, keys):
    """The reference's input for a table with these features: ids concatenated, one bag per (feature, sample)."""
    values, offsets, start = [], [], 0
    for k in keys:
        v, o = batch[k]
        values.append(v)
        offsets.append(o[:-1] + start)
        start += v.numel()
    return torch.cat(values), torch.cat(offsets)


def references():
    return {"users": Reference(USERS, "sum", optim.Adagrad(lr=0.1)),
            "crosses": Reference(CROSSES, "mean", optim.Adagrad(lr=0.1))}


def train_step(ebc, refs, plain, batch, step, use_kjt, g):
    out = ebc(as_kjt(batch)) if use_kjt else ebc(batch)
    out = out.to_dict() if use_kjt else out
    loss = sum((out[k] * g[k]).sum() for k in ("u", "i", "c1", "c2"))
    loss.backward()
    expected = {"u": refs["users"](*lookup_major(batch, ["u"]))}
    expected["c1"], expected["c2"] = refs["crosses"](*lookup_major(batch, ["c1", "c2"])).split(B)
    for k in ("u", "c1", "c2"):
        assert torch.equal(out[k], expected[k]), (step, k)
    sum((expected[k] * g[k]).sum() for k in ("u", "c1", "c2")).backward()
    plain_out = plain({"i": batch["i"]})
    assert torch.equal(out["i"], plain_out["i"]), step
    (plain_out["i"] * g["i"]).sum().backward()


def grads(seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(B, DIM, generator=g) for k in ("u", "i", "c1", "c2")}


def check_tables(ebc, refs):
    for i, t in enumerate(ebc.tables):
        if t.dynamic is not None:
            check_rows_equal(ebc.bags[ebc._table_group[i][0]], refs[t.name])


@needs_torchrec  # every other step feeds a KeyedJaggedTensor
def test_dynamic_tables_train_bit_equal_to_reference_and_round_trip():
    ebc, plain, refs = make_collection(), make_collection(with_dynamic=False), references()
    assert len(ebc.bags) == 3  # each dynamic table is a group of its own
    for step, batch in enumerate(feature_batches(16, seed=0)):
        train_step(ebc, refs, plain, batch, step, use_kjt=step % 2 == 0, g=grads(step))
    check_tables(ebc, refs)
    stats = [ebc.bags[ebc._table_group[i][0]].dynamic_stats() for i in (0, 2)]
    assert all(s["evicted"] > 0 and s["admitted"] > 0 for s in stats), stats

    buf = io.BytesIO()
    torch.save(ebc.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert {"embedding_bags.users.ids", "embedding_bags.users.optimizer.momentum1",
            "embedding_bags.crosses.unadmitted.weight", "embedding_bags.goods.weight"} <= set(state) or \
        {"embedding_bags.users.ids", "embedding_bags.crosses.unadmitted.weight"} <= set(state), sorted(state)
    assert not any(k.startswith("bags.") for k in state), sorted(state)
    fresh = make_collection(seed=1)
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key
    for step, batch in enumerate(feature_batches(6, seed=1)):
        train_step(fresh, refs, plain, batch, 100 + step, use_kjt=True, g=grads(100 + step))
    check_tables(fresh, refs)


@needs_torchrec
def test_dense_input_and_torchrec_configs():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    configs = [EmbeddingBagConfig(name="users", num_embeddings=9, embedding_dim=DIM, feature_names=["u"]),
               EmbeddingBagConfig(name="goods", num_embeddings=20, embedding_dim=DIM, feature_names=["i"])]
    ebc = CachedEmbeddingBagCollection(configs, device="cpu", cache_rows=4, optimizer=optim.SGD(lr=0.1),
                                       dynamic={"users": USERS})
    assert ebc.tables[0].dynamic == USERS and ebc.tables[1].dynamic is None
    ref = Reference(USERS, "sum", optim.SGD(lr=0.1))
    g = torch.Generator().manual_seed(0)
    pool = torch.tensor(POOL)
    for step in range(12):
        ids = torch.stack([pool[torch.randint(0, len(POOL), (B,), generator=g)],
                           torch.randint(0, 20, (B,), generator=g)], dim=1)  # [B, features u, i]
        out = ebc(ids)
        expected = ref(ids[:, 0], torch.arange(B))
        assert torch.equal(out["u"], expected), step
        out["u"].sum().backward()
        expected.sum().backward()
    check_rows_equal(ebc.bags[0], ref)


def test_bad_dynamic_configs_are_refused():
    with pytest.raises(ValueError, match="slab capacity.*DynamicIds.capacity=9, got 10"):
        TableConfig("users", 10, DIM, dynamic=USERS)
    with pytest.raises(ValueError, match="init_fn cannot be used with dynamic ids"):
        TableConfig("users", None, DIM, init_fn=torch.nn.init.zeros_, dynamic=USERS)
    with pytest.raises(ValueError, match="dynamic must be a cachedemb.DynamicIds"):
        TableConfig("users", 9, DIM, dynamic={"capacity": 9})
    with pytest.raises(ValueError, match=r"dynamic= names unknown tables \['user'\]"):
        CachedEmbeddingBagCollection(make_tables(), device="cpu", dynamic={"user": USERS})
    with pytest.raises(ValueError, match="id_freq of table 'users'"):
        CachedEmbeddingBagCollection(make_tables(), device="cpu", id_freq={"users": torch.ones(9)})
    ebc = make_collection()
    with pytest.raises(ValueError, match="table 'users' has dynamic .* no dense weight"):
        ebc.table_weight("users")
    assert cachedemb.DynamicIds is DynamicIds


@needs_torchrec  # the export builds torchrec's collection
def test_dynamic_tables_are_not_exported_to_torchrec():
    with pytest.raises(ValueError, match=r"tables \['users', 'crosses'\] have dynamic"):
        make_collection().to_embedding_bag_collection()


def test_collection_with_dynamic_tables_under_prefetch_is_bit_equal():
    """The collection's prefetch targets remap its dynamic tables ahead; training equals the run without."""
    data = list(feature_batches(12, seed=5))
    runs = []
    for use_prefetch in (False, True):
        ebc = make_collection()
        loader = cachedemb.prefetch(data, [ebc], depth=2, horizon=4) if use_prefetch else data
        outs, ahead = [], 0
        for step, batch in enumerate(loader):
            ahead = max(ahead, sum(rows is not None for bag in ebc.bags if hasattr(bag, "ahead")
                                   for _, rows, _ in bag.ahead))
            out = ebc(batch)
            sum((out[k] * grads(step)[k]).sum() for k in out).backward()
            outs.append(out)
        runs.append((ebc, outs))
        assert (ahead > 0) == use_prefetch  # with prefetch, batches were remapped when read ahead
    (off, want), (on, got) = runs
    for step, (a, b) in enumerate(zip(got, want)):
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)
    state_on = on.state_dict()
    for key, value in off.state_dict().items():
        assert torch.equal(state_on[key], value), key
    assert all(on.bags[g].dynamic_stats()["evicted"] > 0 for g in (0, 2))
