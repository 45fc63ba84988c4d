"""CachedEmbeddingBagCollection equals torchrec's EmbeddingBagCollection: outputs, state_dict, SGD training, DLRM."""
import pytest
import torch

import cachedemb
from cachedemb import optim
from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection, TableConfig

torchrec = pytest.importorskip("torchrec", reason="torchrec not installed")
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: E402

# Every test here runs under both sizing rules (see conftest.sizing_mode).
pytestmark = [pytest.mark.usefixtures("sizing_mode")]

BATCH = 7
# Two dims, both poolings, a table with two features: three groups (8,sum) (8,mean) (4,sum).
TABLES = [
    TableConfig("t_a", 50, 8, ["fa"], "sum"),
    TableConfig("t_b", 31, 8, ["fb1", "fb2"], "mean"),
    TableConfig("t_c", 17, 4, ["fc"], "sum"),
    TableConfig("t_d", 90, 8, ["fd"], "sum"),
]


def ebc_for(tables):
    pooling = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                           feature_names=list(t.feature_names), pooling=pooling[t.pooling]) for t in tables])


def sizes_by_feature(tables):
    return {f: t.num_embeddings for t in tables for f in t.feature_names}


def random_kjt(tables, seed, batch=BATCH, max_len=4, keys=None):
    g = torch.Generator().manual_seed(seed)
    sizes = sizes_by_feature(tables)
    keys = keys or list(sizes)
    lengths = torch.randint(0, max_len + 1, (len(keys), batch), generator=g)
    lengths[:, 0] = 0  # every feature has an empty bag
    values = torch.cat([torch.randint(0, sizes[k], (int(lengths[i].sum()),), generator=g)
                        for i, k in enumerate(keys)])
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths.reshape(-1))


def paired(tables=TABLES, **kwargs):
    ebc = ebc_for(tables)
    coll = CachedEmbeddingBagCollection(tables, cache_rows=5, device="cpu", **kwargs)
    ebc.load_state_dict(coll.state_dict(), strict=False)
    return ebc, coll


def test_table_config_validation():
    with pytest.raises(ValueError, match="pooling"):
        TableConfig("t", 10, 4, ["f"], "max")
    with pytest.raises(ValueError, match="num_embeddings"):
        TableConfig("t", 0, 4, ["f"])
    with pytest.raises(ValueError, match="duplicated feature"):
        TableConfig("t", 10, 4, ["f", "f"])
    # A feature looked up by two tables is allowed (torchrec's `feature@table` keys: test_collection_torchrec).
    shared = CachedEmbeddingBagCollection([TableConfig("a", 10, 4, ["shared"]), TableConfig("b", 10, 4, ["shared"])])
    assert shared.embedding_names == ["shared@a", "shared@b"]
    with pytest.raises(ValueError, match="duplicated table"):
        CachedEmbeddingBagCollection([TableConfig("a", 10, 4, ["x"]), TableConfig("a", 10, 4, ["y"])])


def test_groups_share_one_cache_per_dim_and_pooling():
    coll = CachedEmbeddingBagCollection(TABLES, cache_ratio=0.1)
    assert len(coll.bags) == 3
    assert coll.bags[0].num_embeddings == 50 + 90  # t_a and t_d share the (8, sum) group


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kjt_output_equals_torchrec(seed):
    ebc, coll = paired()
    kjt = random_kjt(TABLES, seed)
    ref, out = ebc(kjt), coll(kjt)
    assert isinstance(out, KeyedTensor)
    assert out.keys() == ref.keys() == ["fa", "fb1", "fb2", "fc", "fd"]
    assert out.length_per_key() == ref.length_per_key()
    torch.testing.assert_close(out.values(), ref.values(), rtol=1e-6, atol=1e-6)
    for k, v in ref.to_dict().items():
        torch.testing.assert_close(out.to_dict()[k], v, rtol=1e-6, atol=1e-6)


def test_kjt_key_order_does_not_matter():
    ebc, coll = paired()
    kjt = random_kjt(TABLES, 3, keys=["fd", "fc", "fb2", "fa", "fb1"])
    torch.testing.assert_close(coll(kjt).values(), ebc(kjt).values(), rtol=1e-6, atol=1e-6)


def test_dict_inputs_offsets_lengths_and_dense():
    ebc, coll = paired()
    kjt = random_kjt(TABLES, 4)
    ref = ebc(kjt).to_dict()
    jt = kjt.to_dict()
    by_offsets = coll({k: (j.values(), j.offsets()) for k, j in jt.items()})
    by_lengths = coll({k: (j.values(), j.lengths()) for k, j in jt.items()}, jagged="lengths")
    by_jagged = coll(jt)
    for out in (by_offsets, by_lengths, by_jagged):
        assert list(out) == ["fa", "fb1", "fb2", "fc", "fd"]
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], rtol=1e-6, atol=1e-6)
    # 2-D fast path: one id per (sample, feature).
    g = torch.Generator().manual_seed(5)
    sizes = sizes_by_feature(TABLES)
    ids = torch.stack([torch.randint(0, sizes[f], (BATCH,), generator=g) for f in coll.feature_names], dim=1)
    dense_out = coll(ids)
    lengths = torch.ones(len(sizes) * BATCH, dtype=torch.int64)
    ref2 = ebc(KeyedJaggedTensor.from_lengths_sync(keys=coll.feature_names, values=ids.t().reshape(-1),
                                                   lengths=lengths)).to_dict()
    for k in ref2:
        torch.testing.assert_close(dense_out[k], ref2[k], rtol=1e-6, atol=1e-6)


def test_hash_ids_folds_ids_into_each_table():
    ebc, coll = paired(hash_ids=True)
    kjt = random_kjt(TABLES, 6)
    sizes = sizes_by_feature(TABLES)
    # Raw ids far outside every table (and negative ones), which hash to the in-range ids.
    raw, folded = [], []
    for k, jt in kjt.to_dict().items():
        v = jt.values()
        big = v + sizes[k] * torch.arange(v.numel()) * 7 - sizes[k] * 3
        raw.append(big)
        folded.append(big % sizes[k])
    hashed = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), torch.cat(raw), kjt.lengths())
    plain = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), torch.cat(folded), kjt.lengths())
    torch.testing.assert_close(coll(hashed).values(), ebc(plain).values(), rtol=1e-6, atol=1e-6)


def test_errors_name_the_feature_and_table():
    coll = CachedEmbeddingBagCollection(TABLES, cache_rows=5)
    kjt = random_kjt(TABLES, 7)
    d = {k: (j.values(), j.offsets()) for k, j in kjt.to_dict().items()}
    with pytest.raises(ValueError, match="unknown feature.*'nope'"):
        coll({**d, "nope": d["fa"]})
    with pytest.raises(ValueError, match="missing feature.*'fc'"):
        coll({k: v for k, v in d.items() if k != "fc"})
    bad = dict(d)
    bad["fc"] = (torch.tensor([0, 17]), torch.tensor([0, 1, 2] + [2] * (BATCH - 2)))
    with pytest.raises(ValueError, match="'fc'.*'t_c'.*17"):
        coll(bad)
    ids = torch.zeros(3, 5, dtype=torch.int64)
    ids[1, 1] = -1
    with pytest.raises(ValueError, match="'fb1'.*'t_b'"):
        coll(ids)


def test_state_dict_matches_torchrec_and_round_trips():
    ebc, coll = paired(optimizer=optim.RowWiseAdagrad(lr=0.1))
    ref = ebc.state_dict()
    sd = coll.state_dict()
    assert set(ref) <= set(sd)
    assert set(sd) - set(ref) == {f"embedding_bags.{t.name}.optimizer.{s}" for t in TABLES
                                  for s in ("sum", "step")}
    for k, v in ref.items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)
    # torchrec's state_dict (weights only) loads strictly; the optimizer state is optional.
    other = CachedEmbeddingBagCollection(TABLES, cache_rows=3, optimizer=optim.RowWiseAdagrad(lr=0.1))
    other.load_state_dict(ref)
    kjt = random_kjt(TABLES, 8)
    torch.testing.assert_close(other(kjt).values(), ebc(kjt).values(), rtol=1e-6, atol=1e-6)
    # Train, then a full round trip (incl. optimizer state) continues identically.
    coll(kjt).values().sum().backward()
    clone = CachedEmbeddingBagCollection(TABLES, cache_rows=2, optimizer=optim.RowWiseAdagrad(lr=0.1))
    clone.load_state_dict(coll.state_dict())
    for k, v in coll.state_dict().items():
        torch.testing.assert_close(clone.state_dict()[k], v, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="Unexpected key.*embedding_bags.t_zz.weight"):
        clone.load_state_dict({**coll.state_dict(), "embedding_bags.t_zz.weight": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="size mismatch for embedding_bags.t_a.weight"):
        clone.load_state_dict({**coll.state_dict(), "embedding_bags.t_a.weight": torch.zeros(3, 8)})


def test_sgd_training_matches_torchrec_with_dense_sgd():
    lr = 0.05
    ebc, coll = paired(optimizer=optim.SGD(lr=lr))
    torch_opt = torch.optim.SGD(ebc.parameters(), lr=lr)
    target = torch.randn(BATCH, sum(t.embedding_dim * len(t.feature_names) for t in TABLES),
                         generator=torch.Generator().manual_seed(0))
    for step in range(8):
        kjt = random_kjt(TABLES, 100 + step)
        torch_opt.zero_grad()
        (torch.tanh(ebc(kjt).values()) * target).sum().backward()
        torch_opt.step()
        (torch.tanh(coll(kjt).values()) * target).sum().backward()
    sd = coll.state_dict()
    for k, v in ebc.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-5)


def test_cache_stats_sum_over_groups_and_flush():
    coll = CachedEmbeddingBagCollection(TABLES, cache_rows=4, optimizer=optim.SGD(lr=0.1))
    kjt = random_kjt(TABLES, 9)
    coll(kjt).values().sum().backward()
    stats = coll.cache_stats()
    per_group = [b.cache_stats()["lookups"] for b in coll.bags]
    assert stats["lookups"] == sum(per_group) == kjt.values().numel()
    coll.flush()
    w = coll.table_weight("t_c")
    assert w.shape == (17, 4)


def test_torchrec_dlrm_accepts_the_collection():
    from torchrec.models.dlrm import DLRM

    tables = [TableConfig(f"t{i}", 20 + i, 8, [f"f{i}"]) for i in range(3)]
    coll = CachedEmbeddingBagCollection(tables, cache_rows=4, optimizer=optim.SGD(lr=0.1))
    model = DLRM(embedding_bag_collection=coll, dense_in_features=5, dense_arch_layer_sizes=[16, 8],
                 over_arch_layer_sizes=[16, 1])
    ebc = ebc_for(tables)
    ebc.load_state_dict(coll.state_dict(), strict=False)
    ref_model = DLRM(embedding_bag_collection=ebc, dense_in_features=5, dense_arch_layer_sizes=[16, 8],
                     over_arch_layer_sizes=[16, 1])
    ref_model.load_state_dict(model.state_dict(), strict=False)
    dense = torch.randn(BATCH, 5)
    kjt = random_kjt(tables, 10)
    logits = model(dense, kjt)
    assert logits.shape == (BATCH, 1)
    torch.testing.assert_close(logits, ref_model(dense, kjt), rtol=1e-5, atol=1e-5)
    logits.sum().backward()  # the fused optimizer steps the embeddings; dense params get .grad
    assert model.dense_arch.model._mlp[0]._linear.weight.grad is not None



@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlap"])
def test_prefetch_over_kjt_batches_trains_identically(overlap):
    """The pipeline reads a collection's ids straight from KeyedJaggedTensor batches (every group's cache)."""
    batches = [random_kjt(TABLES, seed=100 + i, max_len=5) for i in range(12)]

    def run(use_prefetch):
        torch.manual_seed(0)
        coll = CachedEmbeddingBagCollection(TABLES, cache_rows=40, device="cpu", optimizer=optim.Adam(lr=0.05))
        source = (cachedemb.prefetch(batches, [coll], depth=3, horizon=6, overlap=overlap) if use_prefetch
                  else batches)
        for kjt in source:
            coll(kjt).values().tanh().sum().backward()
        return {k: v.clone() for k, v in coll.state_dict().items()}, coll.cache_stats()

    (with_pipe, stats), (without, _) = run(True), run(False)
    assert stats["windows"] > 0 and stats["misses"] == stats["window_misses"] == stats["rows_in"]
    assert with_pipe.keys() == without.keys()
    for key in without:
        assert torch.equal(with_pipe[key], without[key]), key


def test_import_does_not_load_torchrec():
    """torchrec costs seconds to import: the collection meets its types only once the caller has imported it."""
    import subprocess
    import sys

    code = ("import sys, cachedemb; assert 'torchrec' not in sys.modules, 'torchrec imported'; "
            "c = cachedemb.CachedEmbeddingBagCollection([cachedemb.TableConfig('t', 10, 4, ['f'])], device='cpu'); "
            "c({'f': (__import__('torch').tensor([1, 2]), __import__('torch').tensor([0, 1, 2]))}); "
            "assert 'torchrec' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
