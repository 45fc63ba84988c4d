"""CachedEmbeddingBagCollection built from torchrec's own EmbeddingBagConfigs against torchrec's
EmbeddingBagCollection on the same inputs: seeded init, outputs and keys, per-sample weights, training (fused
optimizer vs torch.optim on EBC; optimizer=None gradients), `embedding_bags[t].weight` reads and writes, meta
construction, fx tracing, export, torch.compile and TorchScript's refusal. Both kernel backends."""
import copy
import functools
import os

import pytest
import torch

from cachedemb import optim
from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection, NotScriptableError, TableConfig

torchrec = pytest.importorskip("torchrec", reason="torchrec not installed")
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: E402
from torchrec.types import DataType  # noqa: E402

BATCH = 4


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Every kernel on the pure-torch reference, or on its Triton kernel (the interpreter on CPU)."""
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available():
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    monkeypatch.setenv("CACHEDEMB_BACKEND", request.param)
    return request.param


def configs(data_type_c=DataType.FP16):
    """Fresh configs (torchrec's EBC rewrites empty feature_names in place): a feature shared by two tables
    ("shared" -> shared@t_a, shared@t_b), a table with no feature names (looked up by "t_c"), both poolings, an
    FP16 table, a custom init_fn; groups (4, sum, fp32) = t_a + t_d, (4, mean), (6, sum, fp16)."""
    return [
        EmbeddingBagConfig(name="t_a", num_embeddings=30, embedding_dim=4, feature_names=["fa", "shared"],
                           init_fn=functools.partial(torch.nn.init.normal_, mean=0.0, std=0.5)),
        EmbeddingBagConfig(name="t_b", num_embeddings=20, embedding_dim=4, feature_names=["shared"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t_c", num_embeddings=15, embedding_dim=6, feature_names=[],
                           data_type=data_type_c),
        EmbeddingBagConfig(name="t_d", num_embeddings=25, embedding_dim=4, feature_names=["fd"]),
    ]


SIZES = {"fa": 30, "shared": 20, "t_c": 15, "fd": 25, "unused": 1000}
KEYS = ["fd", "shared", "unused", "t_c", "fa"]  # not in table order, and a key no table uses


def random_kjt(seed, keys=KEYS, max_len=3, weighted=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys), BATCH), generator=g)
    lengths[:, 0] = 0  # an empty bag in every feature
    values = torch.cat([torch.randint(0, SIZES[k], (int(n),), generator=g) for k, n in zip(keys, lengths.sum(1))])
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths.reshape(-1), weights=weights)


def pair(make_configs=configs, seed=0, **kwargs):
    """torchrec's EBC and ours, each built after the same manual_seed from its own (equal) configs."""
    kwargs.setdefault("cache_rows", 4)  # smaller than every group: misses, evictions, host-served rows
    kwargs.setdefault("device", "cpu")
    is_weighted = kwargs.pop("is_weighted", False)
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(make_configs(), is_weighted=is_weighted)
    torch.manual_seed(seed)
    coll = CachedEmbeddingBagCollection(make_configs(), is_weighted=is_weighted, **kwargs)
    return ebc, coll


def assert_same_output(out, ref, atol=1e-6):
    assert isinstance(out, KeyedTensor)
    assert out.keys() == ref.keys()
    assert out.length_per_key() == ref.length_per_key()
    assert out.values().dtype == ref.values().dtype == torch.float32
    torch.testing.assert_close(out.values(), ref.values(), rtol=atol, atol=atol)


def assert_same_tables(coll, ebc, atol=0.0):
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(coll.embedding_bags[name].weight, bag.weight, rtol=atol, atol=atol, msg=name)


# ----------------------------------------------------------------- construction
def test_seeded_init_equals_torchrec_and_configs_are_kept():
    ebc, coll = pair(seed=3)
    assert_same_tables(coll, ebc)  # nn.EmbeddingBag's normal_ draws, then each init_fn: the same numbers
    assert coll.embedding_bags["t_c"].weight.dtype == torch.float16
    assert [c.feature_names for c in coll.embedding_bag_configs()] == [c.feature_names
                                                                         for c in ebc.embedding_bag_configs()]
    assert coll.embedding_bag_configs()[2].feature_names == ["t_c"]  # as torchrec rewrites it
    assert len(coll.bags) == 3 and not coll.is_weighted() and coll.device == torch.device("cpu")
    # reset_parameters re-runs the init_fns, drawing as torchrec's does.
    torch.manual_seed(11)
    ebc.reset_parameters()
    torch.manual_seed(11)
    coll.reset_parameters()
    assert_same_tables(coll, ebc)
    # BF16: torchrec 1.8 keeps it as float16; ours is bfloat16, from the same draws.
    ebc16, coll16 = pair(lambda: configs(DataType.BF16), seed=4)
    assert coll16.embedding_bags["t_c"].weight.dtype == torch.bfloat16
    torch.testing.assert_close(coll16.embedding_bags["t_c"].weight.float(), ebc16.embedding_bags["t_c"].weight.float(),
                               rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="duplicated table name"):
        CachedEmbeddingBagCollection(configs() + configs()[:1])
    with pytest.raises(ValueError, match="INT8"):
        CachedEmbeddingBagCollection([EmbeddingBagConfig(name="q", num_embeddings=3, embedding_dim=2,
                                                         feature_names=["q"], data_type=DataType.INT8)])


def test_state_dict_keys_and_values_as_torchrec():
    ebc, coll = pair(optimizer=optim.Adagrad(lr=0.1))
    ref, sd = ebc.state_dict(), coll.state_dict()
    assert [k for k in sd if k.endswith(".weight")] == list(ref)
    for k, v in ref.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    # torchrec's weights load into ours (and ours into torchrec's, ignoring the optimizer keys).
    torch.manual_seed(99)
    other = EmbeddingBagCollection(configs())
    coll.load_state_dict(other.state_dict(), strict=False)
    assert_same_tables(coll, other)
    ebc.load_state_dict(coll.state_dict(), strict=False)
    assert_same_tables(coll, ebc)


# ----------------------------------------------------------------- forward
@pytest.mark.parametrize("seed", [0, 1])
def test_outputs_equal_torchrec(backend, sizing_mode, seed):
    ebc, coll = pair(seed=seed)
    for step in range(2):
        kjt = random_kjt(10 * seed + step)
        ref = ebc(kjt)
        assert ref.keys() == ["fa", "shared@t_a", "shared@t_b", "t_c", "fd"]
        assert_same_output(coll(kjt), ref, atol=1e-3)  # t_c is float16 (torchrec pools it in float16)
    # The dict input gives the same keys.
    kjt = random_kjt(5)
    jt = kjt.to_dict()
    out = coll({k: (jt[k].values(), jt[k].offsets()) for k in coll.feature_names})
    assert list(out) == ebc(kjt).keys()
    for k, v in ebc(kjt).to_dict().items():
        torch.testing.assert_close(out[k], v, rtol=1e-3, atol=1e-3)


def test_missing_feature_is_an_error():
    coll = pair()[1]
    with pytest.raises(ValueError, match="missing feature.*'t_c'"):
        coll(random_kjt(0, keys=["fd", "shared", "fa"]))


def sum_configs():
    return [EmbeddingBagConfig(name="w1", num_embeddings=12, embedding_dim=3, feature_names=["f1", "f3"]),
            EmbeddingBagConfig(name="w2", num_embeddings=12, embedding_dim=4, feature_names=["f2"])]


def test_per_sample_weights_and_their_gradient(backend):
    ebc, coll = pair(sum_configs, is_weighted=True, optimizer=optim.SGD(lr=0.0))
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 12, (14,), generator=g)
    weights = torch.rand(14, generator=g)
    lengths = torch.tensor([2, 0, 3, 1, 1, 2, 0, 1, 2, 1, 1, 0])  # 3 keys x batch 4

    def kjt(w):
        return KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f3", "f2"], values=values, lengths=lengths,
                                                   weights=w)
    w_ref, w_ours = weights.clone().requires_grad_(), weights.clone().requires_grad_()
    ref, out = ebc(kjt(w_ref)), coll(kjt(w_ours))
    assert ref.keys() == ["f1", "f3", "f2"] and ref.offset_per_key() == [0, 3, 6, 10]
    assert_same_output(out, ref, atol=1e-6)
    target = torch.randn(ref.values().shape, generator=g)
    (ref.values() * target).sum().backward()
    (out.values() * target).sum().backward()
    torch.testing.assert_close(w_ours.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no weights"):
        coll(KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f3", "f2"], values=values, lengths=lengths))
    # An FP16 table takes the KJT's float32 weights (cast to the table's dtype; torchrec's EBC refuses them).
    half = CachedEmbeddingBagCollection([TableConfig("w1", 12, 3, ["f1", "f3"]),
                                         TableConfig("w2", 12, 4, ["f2"], dtype=torch.float16)],
                                        is_weighted=True, device="cpu", cache_rows=4)
    half.load_state_dict(ebc.state_dict())
    torch.testing.assert_close(half(kjt(weights)).values(), ref.values().detach(), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------- training
def fp32_configs():
    return configs(DataType.FP32)


@pytest.mark.parametrize("name,sizing_mode", [("sgd", "sync_free"), ("adagrad", "exact")], indirect=["sizing_mode"])
def test_fused_training_equals_torchrec_with_torch_optim(backend, sizing_mode, name):
    fused, torch_opt = {"sgd": (optim.SGD(lr=0.2), functools.partial(torch.optim.SGD, lr=0.2)),
                        "adagrad": (optim.Adagrad(lr=0.2), functools.partial(torch.optim.Adagrad, lr=0.2))}[name]
    ebc, coll = pair(fp32_configs, optimizer=fused)
    opt = torch_opt(ebc.parameters())
    target = torch.randn(BATCH, 22, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        kjt = random_kjt(100 + step)
        opt.zero_grad()
        ref = ebc(kjt)
        (torch.tanh(ref.values()) * target).sum().backward()
        opt.step()
        out = coll(kjt)
        torch.testing.assert_close(out.values(), ref.values(), rtol=1e-5, atol=1e-5)
        (torch.tanh(out.values()) * target).sum().backward()
    assert_same_tables(coll, ebc, atol=1e-5)


def test_optimizer_none_gradient_and_torch_optim_equal_torchrec(backend):
    """optimizer=None: each group's `weight` is the Parameter (its rows back to back); its gradient, sliced per
    table, is torchrec's per-table gradient, and a torch optimizer over parameters() trains like torchrec's."""
    ebc, coll = pair(fp32_configs, optimizer=None)
    target = torch.randn(BATCH, 22, generator=torch.Generator().manual_seed(2))
    opt_ref = torch.optim.Adagrad(ebc.parameters(), lr=0.1)
    opt = torch.optim.Adagrad(coll.parameters(), lr=0.1)
    for step in range(2):
        kjt = random_kjt(200 + step)
        for o in (opt_ref, opt):
            o.zero_grad()
        (torch.tanh(ebc(kjt).values()) * target).sum().backward()
        (torch.tanh(coll(kjt).values()) * target).sum().backward()
        for i, t in enumerate(coll.tables):
            g, lo = coll._table_group[i]
            grad = coll.bags[g].weight.grad[lo:lo + t.num_embeddings]
            torch.testing.assert_close(grad, ebc.embedding_bags[t.name].weight.grad, rtol=1e-5, atol=1e-6)
        opt_ref.step()
        opt.step()
    assert_same_tables(coll, ebc, atol=1e-6)
    kjt = random_kjt(300)
    assert_same_output(coll(kjt), ebc(kjt), atol=1e-5)


def test_weight_views_read_and_write_through(backend):
    ebc, coll = pair(fp32_configs, optimizer=optim.SGD(lr=0.3))
    opt = torch.optim.SGD(ebc.parameters(), lr=0.3)
    for step in range(2):  # trained rows sit in the caches, not yet written back
        kjt = random_kjt(400 + step)
        opt.zero_grad()
        ebc(kjt).values().sum().backward()
        opt.step()
        coll(kjt).values().sum().backward()
    assert_same_tables(coll, ebc, atol=1e-6)  # reading `weight` writes the cached updates back first
    view = coll.embedding_bags["t_a"].weight
    assert view.shape == (30, 4) and view.device == torch.device("cpu")
    with torch.no_grad():
        for bags in (coll.embedding_bags, ebc.embedding_bags):
            bags["t_a"].weight[3:7] = 0.25  # rows that may be cached
            bags["t_d"].weight.data.mul_(-2.0)  # through .data
            torch.nn.init.constant_(bags["t_b"].weight, 0.5)
    for step in range(2):
        kjt = random_kjt(500 + step)
        assert_same_output(coll(kjt), ebc(kjt), atol=1e-5)


# ----------------------------------------------------------------- meta device
def test_meta_construction_allocates_nothing_then_materializes(backend):
    for make in (lambda: CachedEmbeddingBagCollection(configs(), device=torch.device("meta")),
                 lambda: _under_meta(lambda: CachedEmbeddingBagCollection(configs()))):
        coll = make()
        assert len(coll.bags) == 0 and coll.cache_stats() == {"seconds": {}}  # no host table, no cache
        assert coll.device == torch.device("meta")
        assert coll.embedding_bags["t_a"].weight.device == torch.device("meta")
        assert coll.embedding_bags["t_a"].weight.shape == (30, 4)
        assert all(v.is_meta for v in coll.state_dict().values())
        coll.reset_parameters()  # nothing to initialize, as torchrec's
        kjt = random_kjt(0).to(torch.device("meta"))
        out = coll(kjt)
        assert out.values().device == torch.device("meta") and out.values().shape == (BATCH, 22)
        assert out.keys() == ["fa", "shared@t_a", "shared@t_b", "t_c", "fd"]
    # to_empty materializes (zeroed); reset_parameters initializes as torchrec's reset_parameters does.
    ebc = EmbeddingBagCollection(configs())
    coll.to_empty(device="cpu")
    assert coll.device == torch.device("cpu") and len(coll.bags) == 3
    torch.manual_seed(7)
    ebc.reset_parameters()
    torch.manual_seed(7)
    coll.reset_parameters()
    assert_same_tables(coll, ebc)
    kjt = random_kjt(1)
    # .to(device) from meta materializes too; .to("meta") drops the tables again.
    again = CachedEmbeddingBagCollection(configs(), device="meta").half().to("cpu")
    assert len(again.bags) == 3 and again.embedding_bags["t_d"].weight.abs().sum() == 0
    assert again.embedding_bags["t_a"].weight.dtype == torch.float16
    again.to("meta")
    assert len(again.bags) == 0 and again.device == torch.device("meta")
    assert_same_output(coll(kjt), ebc(kjt), atol=1e-3)


def _under_meta(build):
    with torch.device("meta"):
        return build()


# ----------------------------------------------------------------- graph capture
def dlrm_pair(optimizer=None):
    """torchrec's DLRM over torchrec's EBC and over ours, with equal weights (all tables of one dim)."""
    def make():
        return [EmbeddingBagConfig(name="t1", num_embeddings=20, embedding_dim=4, feature_names=["f1", "f3"]),
                EmbeddingBagConfig(name="t2", num_embeddings=15, embedding_dim=4, feature_names=["f2"])]
    ebc, coll = pair(make, optimizer=optimizer)
    models = []
    for sparse in (ebc, coll):
        torch.manual_seed(5)
        models.append(DLRM(embedding_bag_collection=sparse, dense_in_features=6, dense_arch_layer_sizes=[8, 4],
                           over_arch_layer_sizes=[5, 1]))
    return models


def dlrm_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([2, 1, 0, 3, 1, 1, 2, 0, 1, 2, 2, 1])  # 3 keys x batch 4; same shapes every seed
    values = torch.randint(0, 15, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=values, lengths=lengths)
    return torch.rand(BATCH, 6, generator=g), kjt


def test_fx_symbolic_trace_runs_the_collection(backend):
    from torchrec.fx import symbolic_trace as torchrec_trace

    ref_model, model = dlrm_pair(optimizer=optim.SGD(lr=0.1))
    for trace in (torch.fx.symbolic_trace, torchrec_trace):
        gm = trace(model)
        assert "sparse_arch.embedding_bag_collection.embedding_bags.t1.weight" in gm.state_dict()
        for seed in range(2):
            dense, kjt = dlrm_inputs(seed)
            torch.testing.assert_close(gm(dense, kjt), ref_model(dense, kjt), rtol=1e-5, atol=1e-6)
    # Training through the traced graph steps the (shared) collection's fused optimizer.
    steps = model.sparse_arch.embedding_bag_collection.bags[0].optimizer_step
    gm(*dlrm_inputs(3)).sum().backward()
    assert model.sparse_arch.embedding_bag_collection.bags[0].optimizer_step == steps + 1
    # The collection as the traced root.
    coll = model.sparse_arch.embedding_bag_collection
    kjt = dlrm_inputs(4)[1]
    assert_same_output(torch.fx.symbolic_trace(coll)(kjt), coll(kjt))


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_export_gives_the_same_outputs(backend, strict):
    ref_model, model = dlrm_pair()
    dense, kjt = dlrm_inputs(0)
    ep = torch.export.export(model, (dense, kjt), strict=strict)
    assert "cachedemb.collection_lookup" in ep.graph_module.code
    exported = ep.module()
    for seed in range(3):
        dense, kjt = dlrm_inputs(seed)
        with torch.no_grad():
            torch.testing.assert_close(exported(dense, kjt), ref_model(dense, kjt), rtol=1e-5, atol=1e-6)
    # A copy of the model is its own collection in its own exported program.
    twin = copy.deepcopy(model)
    twin.sparse_arch.embedding_bag_collection.embedding_bags["t1"].weight.data.zero_()
    twin_ep = torch.export.export(twin, (dense, kjt), strict=False).module()
    with torch.no_grad():
        torch.testing.assert_close(exported(dense, kjt), ref_model(dense, kjt), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(twin_ep(dense, kjt), twin(dense, kjt), rtol=1e-5, atol=1e-6)


def test_torch_compile_trains_like_eager():
    ref_model, model = dlrm_pair(optimizer=optim.SGD(lr=0.1))
    opt = torch.optim.SGD(ref_model.sparse_arch.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    for seed in range(2):
        dense, kjt = dlrm_inputs(seed)
        opt.zero_grad()
        ref = ref_model(dense, kjt)
        ref.sum().backward()
        opt.step()
        out = compiled(dense, kjt)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        out.sum().backward()
    assert_same_tables(model.sparse_arch.embedding_bag_collection, ref_model.sparse_arch.embedding_bag_collection,
                       atol=1e-6)


def test_torchscript_is_refused_with_a_way_out(monkeypatch):
    import conftest

    monkeypatch.setattr(torch, "empty", conftest._real_empty)  # TorchScript compiles what torchrec's EBC calls
    ref_model, model = dlrm_pair()
    coll = model.sparse_arch.embedding_bag_collection
    for target in (coll, model, torch.fx.symbolic_trace(model)):
        with pytest.raises(NotScriptableError, match="to_embedding_bag_collection.*symbolic_trace.*export"):
            torch.jit.script(target)
    with pytest.raises(NotScriptableError, match="torch.jit.trace"):  # would bake one batch's cache plan in
        torch.jit.trace(coll, (torch.zeros(2, 3, dtype=torch.int64),))
    scripted = torch.jit.script(coll.to_embedding_bag_collection())
    kjt = dlrm_inputs(0)[1]
    assert_same_output(scripted(kjt), coll(kjt))


def test_empty_table_list_as_torchrec():
    coll = CachedEmbeddingBagCollection([], device="cpu")
    out = coll(random_kjt(0, keys=["unused"]))
    assert out.keys() == [] and out.values().shape == (BATCH, 0)
    with pytest.raises(AssertionError):
        DLRM(embedding_bag_collection=coll, dense_in_features=4, dense_arch_layer_sizes=[4, 1],
             over_arch_layer_sizes=[2, 1])


def test_table_config_gets_the_same_treatment():
    """Our own TableConfig: empty feature_names, dtype, init_fn, shared features, as the torchrec configs."""
    tables = [TableConfig("a", 10, 2, ["x", "y"], init_fn=torch.nn.init.ones_),
              TableConfig("b", 8, 2, ["y"], "mean", dtype=torch.float16), TableConfig("c", 6, 3)]
    coll = CachedEmbeddingBagCollection(tables, device="cpu", cache_rows=2)
    assert coll.embedding_names == ["x", "y@a", "y@b", "c"] and coll.feature_names == ["x", "y", "c"]
    assert torch.equal(coll.embedding_bags["a"].weight, torch.ones(10, 2))
    assert coll.embedding_bags["b"].weight.dtype == torch.float16
    assert coll.embedding_bag_configs() == tables
    ebc = coll.to_embedding_bag_collection()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["c", "x", "y"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7]),
                                              lengths=torch.tensor([1, 1, 2, 0, 1, 2]))
    assert_same_output(coll(kjt), ebc(kjt), atol=1e-3)
