"""Cached tables built on the meta device: nothing allocated, shapes-only forward and state_dict, clear errors,
`to_empty()` + `reset_parameters()` and `cachedemb.materialize(model)` giving exactly the values the model
built on a real device has; and the chunked replay of an initialization over a row range (what shard() uses)
drawing exactly what one whole-table fill draws, generator state included."""
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb.modules import meta_init
from cachedemb.materialize import materialize
from cachedemb.modules.meta_init import TableInit, init_rows


# ----------------------------------------------------------------- chunked replay of an init
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("init", ["normal", "uniform", "init_fn"])
def test_init_rows_equals_one_whole_table_fill(monkeypatch, dtype, init):
    monkeypatch.setattr(meta_init, "CHUNK_ELEMENTS", 48)  # many chunks, tails shorter than a block
    rows, dim = 37, 5  # 185 elements: chunk edges fall inside rows
    spec = {"normal": TableInit.normal(padding_idx=11), "uniform": TableInit.uniform(rows),
            "init_fn": TableInit(nn.init.xavier_uniform_, elementwise=False)}[init]
    torch.manual_seed(5)
    whole = torch.empty(rows, dim, dtype=dtype)
    spec.fill(whole)
    if spec.padding_idx is not None:
        whole[spec.padding_idx] = 0
    after_whole = torch.rand(3)
    for start, end in [(0, rows), (0, 1), (3, 20), (10, 12), (36, 37), (20, 20), (0, 0), (37, 37)]:
        torch.manual_seed(5)
        part = init_rows(spec, rows, dim, dtype, start, end)
        assert torch.equal(part, whole[start:end]), (start, end)
        assert torch.equal(torch.rand(3), after_whole), (start, end)  # the generator ends where one fill ends


def test_init_rows_refuses_a_range_outside_the_table():
    with pytest.raises(ValueError, match=r"\[3, 9\).*8 rows"):
        init_rows(TableInit.normal(), 8, 2, torch.float32, 3, 9)


# ----------------------------------------------------------------- a meta CachedEmbeddingBag
def test_meta_module_allocates_nothing_and_has_shapes():
    opt = cachedemb.optim.Adagrad(lr=0.1)
    for make in (lambda: cachedemb.CachedEmbeddingBag(10**9, 64, mode="sum", optimizer=opt, device="meta"),
                 lambda: _under_meta(lambda: cachedemb.CachedEmbeddingBag(10**9, 64, mode="sum", optimizer=opt))):
        m = make()  # a 256 GB table: only possible because nothing is allocated
        assert m.is_meta and "device=meta" in repr(m)
        assert m.weight.is_meta and m.weight.shape == (10**9, 64)
        out = m(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3]))
        assert out.is_meta and out.shape == (3, 64)
        assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == {"weight": (10**9, 64)}
        for call in (m.flush, m.cache_stats, lambda: m.load_state_dict({"weight": torch.zeros(1, 64).expand(10**9, 64)})):
            with pytest.raises(RuntimeError, match="meta device.*to_empty.*reset_parameters"):
                call()


def _under_meta(build):
    with torch.device("meta"):
        return build()


@pytest.mark.parametrize("optimizer", [None, cachedemb.optim.Adam(lr=0.1)])
def test_to_empty_then_reset_parameters_equals_a_module_built_on_cpu(optimizer):
    torch.manual_seed(2)
    ref = nn.EmbeddingBag(50, 6, mode="sum", padding_idx=4)
    torch.manual_seed(2)
    built = cachedemb.CachedEmbeddingBag(50, 6, mode="sum", padding_idx=4, cache_rows=5, optimizer=optimizer,
                                         device="cpu")
    torch.manual_seed(2)
    meta = cachedemb.CachedEmbeddingBag(50, 6, mode="sum", padding_idx=4, cache_rows=5, optimizer=optimizer,
                                        device="meta")
    meta.to_empty(device="cpu")
    assert not meta.is_meta and torch.count_nonzero(meta.weight) == 0  # to_empty: allocated, not drawn
    meta.reset_parameters()
    assert torch.equal(built.weight, ref.weight) and torch.equal(meta.weight, ref.weight)
    assert meta.weight.requires_grad == (optimizer is None)
    ids, offsets = torch.tensor([1, 4, 9, 9, 30, 2]), torch.tensor([0, 2, 5])
    for _ in range(3):  # and it trains as the module built on cpu
        for m in (built, meta):
            m(ids, offsets).square().sum().backward()
            if optimizer is None:
                with torch.no_grad():
                    m.weight -= 0.1 * m.weight.grad
                m.weight.grad = None
    assert torch.equal(built.weight, meta.weight)
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), meta.state_dict().values()))


def test_meta_dtype_conversion_then_materialize():
    m = cachedemb.CachedEmbeddingBag(20, 3, device="meta").half()
    assert m.weight.dtype == torch.float16 and m.is_meta
    m.to("cpu")
    assert m.weight.dtype == torch.float16 and m.weight.device.type == "cpu" and not m.is_meta


class _Model(nn.Module):
    # Explicit devices: the tests' NaN-poisoned torch.empty hides factory calls from `with torch.device(...)`.
    def __init__(self, device=None):
        super().__init__()
        self.bottom = nn.Linear(4, 3, device=device)
        self.emb = cachedemb.CachedEmbeddingBag(300, 4, mode="sum", padding_idx=7, cache_rows=9, device=device,
                                                optimizer=cachedemb.optim.RowWiseAdagrad(lr=0.1))
        self.norm = nn.LayerNorm(7, device=device)
        self.top = nn.Linear(7, 1, device=device)


def test_materialize_gives_the_values_of_the_model_built_on_a_device():
    torch.manual_seed(0)
    built = _Model()
    after_built = torch.rand(4)
    torch.manual_seed(0)
    model = _Model("meta")
    assert materialize(model, "cpu") is model
    assert torch.equal(torch.rand(4), after_built)  # the same draws, in the same order
    ref, got = built.state_dict(), model.state_dict()
    assert list(ref) == list(got)
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    assert not any(p.is_meta for p in model.parameters())


def test_materialize_refuses_a_meta_module_it_cannot_initialize_before_changing_anything():
    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(cachedemb.CachedEmbeddingBag(10, 2), NoReset())
    model[1].w = nn.Parameter(torch.empty(3, device="meta"))  # (the poisoned torch.empty made it on cpu)
    with pytest.raises(TypeError, match=r"'1' \(NoReset\).*no reset_parameters"):
        materialize(model, "cpu")
    assert model[0].is_meta  # nothing was allocated


def test_materialize_collection_equals_its_to_empty_and_reset_parameters():
    tables = [cachedemb.TableConfig("a", 40, 4, ["fa"]),
              cachedemb.TableConfig("b", 30, 4, ["fb"], init_fn=nn.init.xavier_uniform_)]
    torch.manual_seed(1)
    ref = cachedemb.CachedEmbeddingBagCollection(tables, device="meta", cache_rows=8)
    ref.to_empty(device="cpu")
    ref.reset_parameters()
    torch.manual_seed(1)
    coll = materialize(cachedemb.CachedEmbeddingBagCollection(tables, device="meta", cache_rows=8), "cpu")
    for name in ("a", "b"):
        assert torch.equal(coll.embedding_bags[name].weight, ref.embedding_bags[name].weight)
    bound = (1 / 40) ** 0.5
    assert coll.embedding_bags["a"].weight.abs().max() <= bound and coll.embedding_bags["a"].weight.std() > 0
