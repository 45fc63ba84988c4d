"""CachedEmbeddingBag as nn.EmbeddingBag in the places users touch besides forward: `weight` (writes, replacement,
its id-space gradient under torch optimizers), dtype conversions, max_norm, scale_grad_by_freq, include_last_offset
with lookups past offsets[-1], and exception types. Each against nn.EmbeddingBag / nn.Embedding or a brute-force
float64 computation, on both kernel backends (Triton under the interpreter) and both sizing rules."""
import pytest
import torch
from torch import nn

import cachedemb
from conftest import skip_triton_on_cpu_without_interpreter

pytestmark = [pytest.mark.usefixtures("sizing_mode")]


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch, sizing_mode):
    # What these tests check is the module's handling of the table (Python-side); the Triton kernels under the
    # sync-free sizing are covered by test_sync_free / test_triton_backend, so that combination (the slowest
    # under the interpreter) runs with --slow only.
    if request.param == "triton" and sizing_mode == "sync_free" and not request.config.getoption("--slow"):
        pytest.skip("slow: Triton under sync-free sizing repeats test_sync_free's kernel coverage; --slow runs it")
    skip_triton_on_cpu_without_interpreter(request.param)
    monkeypatch.setenv("CACHEDEMB_BACKEND", request.param)
    return request.param


def pair(num=12, dim=4, cache_rows=3, seed=0, dtype=torch.float32, **kw):
    """nn.EmbeddingBag and ours on the same table (ours caches fewer rows than a batch touches)."""
    torch.manual_seed(seed)
    ref = nn.EmbeddingBag(num, dim, dtype=dtype, **kw)
    ours = cachedemb.CachedEmbeddingBag(num, dim, cache_rows=cache_rows, device="cpu", dtype=dtype,
                                        _weight=ref.weight.detach().clone(), **kw)
    return ref, ours


def batch(seed, num=12, lookups=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num, (lookups,), generator=g)
    return ids, torch.tensor([0, 3, 3, 7])


# ----------------------------------------------------------------- weight
@pytest.mark.parametrize("write", ["setitem", "init", "data_copy", "held_data", "held_data_eval"])
def test_weight_writes_are_seen_and_kept(backend, write):
    ref, ours = pair(mode="sum")
    ids, offsets = batch(1)
    ours(ids, offsets).sum().backward()  # rows of the batch are cached now
    held = ours.weight
    if write == "held_data_eval":
        with torch.no_grad():
            ours.eval()(ids, offsets)  # an eval forward reads cached rows: the write below must reach them
    else:
        ours(ids, offsets)
    row = int(ids[0])
    value = torch.arange(4.0)
    with torch.no_grad():
        if write == "setitem":
            ours.weight[row] = value
        elif write == "init":
            nn.init.constant_(ours.weight, 0.5)
        elif write == "data_copy":
            ours.weight.data.copy_(torch.full((12, 4), 2.0))
        else:
            held.data[row] = value  # through .data of a reference taken before the last forward
    if write == "held_data_eval":
        ours.train()
    expected = ours.cache.host_weight.clone()
    ref.weight.data.copy_(expected)
    torch.testing.assert_close(ours(ids, offsets), ref(ids, offsets), rtol=0, atol=0)
    ours.flush()
    assert torch.equal(ours.cache.host_weight, expected)  # a flush never writes a stale cached row over it
    state = ours.state_dict()["weight"]
    assert torch.equal(state, expected)


def test_weight_write_reaches_rows_updated_by_the_fused_optimizer(backend):
    """Fused training, then `m.weight` (which writes the cache back), then a write: nothing is lost."""
    ours = cachedemb.CachedEmbeddingBag(12, 4, mode="sum", cache_rows=3, device="cpu",
                                        optimizer=cachedemb.optim.SGD(lr=0.5))
    ids, offsets = batch(2)
    before = ours.cache.host_weight.clone()
    ours(ids, offsets).sum().backward()
    trained = ours.weight.detach().clone()  # flushes: the update is in the table
    assert not torch.equal(trained, before)
    with torch.no_grad():
        ours.weight[int(ids[0])] = 9.0
    trained[int(ids[0])] = 9.0
    with torch.no_grad():
        out = ours(ids, offsets)
    ref = nn.EmbeddingBag.from_pretrained(trained, mode="sum")
    torch.testing.assert_close(out, ref(ids, offsets), rtol=0, atol=0)


@pytest.mark.parametrize("holder", ["weight_data", "weight_setitem", "state_dict_data", "pretrained_tensor"])
def test_writes_through_a_held_table_across_fused_steps_are_kept(backend, holder):
    """A reference to the table kept across fused steps (writes through `.data` move no version counter):
    every write through it is seen by the next forward and kept, the optimizer's updates too, as with
    nn.EmbeddingBag + torch.optim.SGD. Once the reference is dropped the module leaves the write-through mode."""
    torch.manual_seed(0)
    table = torch.randn(12, 4)
    ref = nn.EmbeddingBag.from_pretrained(table.clone(), freeze=False, mode="sum")
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    given = table.clone()
    ours = cachedemb.CachedEmbeddingBag(12, 4, mode="sum", cache_rows=3, device="cpu", _weight=given,
                                        optimizer=cachedemb.optim.SGD(lr=0.5))
    if holder == "pretrained_tensor":
        held = given  # nn.EmbeddingBag(_weight=t) shares t's memory on CPU: so does ours
    elif holder == "state_dict_data":
        held = ours.state_dict()["weight"].data
    else:
        held = ours.weight
    del given
    with pytest.warns(UserWarning, match="held outside the module"):
        ours(*batch(9))
    for step in range(4):
        ids, offsets = batch(20 + step)
        g = torch.randn(4, 4)
        out = ours(ids, offsets)
        torch.testing.assert_close(out, ref(ids, offsets), rtol=0, atol=0)
        out.backward(g)
        ref(ids, offsets).backward(g)
        opt.step()
        opt.zero_grad()
        row, value = int(ids[step]), torch.full((4,), float(step))
        with torch.no_grad():
            if holder == "weight_setitem":
                held[row] = value
            else:
                held.data[row] = value
            ref.weight[row] = value
    del held
    ids, offsets = batch(30)
    torch.testing.assert_close(ours(ids, offsets), ref(ids, offsets), rtol=0, atol=0)
    assert not ours._watched
    ours.flush()
    torch.testing.assert_close(ours.cache.host_weight, ref.weight.detach(), rtol=0, atol=0)


def test_a_table_nobody_holds_stays_on_the_fast_path(backend):
    """Taking (and dropping) weight, state_dict or weight.data does not leave the module in write-through."""
    ours = cachedemb.CachedEmbeddingBag(12, 4, mode="sum", cache_rows=3, device="cpu",
                                        _weight=torch.randn(12, 4), optimizer=cachedemb.optim.Adagrad(lr=0.5))
    for step in range(3):
        ids, offsets = batch(50 + step)
        ours(ids, offsets).sum().backward()
        ours.state_dict()
        ours.weight.data.sum()
        with torch.no_grad():
            ours.weight[0] = 1.0
        assert not ours._table_shared()
    ours(*batch(60)).sum().backward()
    assert not ours._watched and ours.cache.maybe_dirty  # the step's updates stay in the cache (no write-through)


def test_weight_assignment_replaces_the_table(backend):
    ref, ours = pair(mode="mean")
    ids, offsets = batch(4)
    ours(ids, offsets)
    new = torch.randn(12, 4)
    ours.weight = nn.Parameter(new.clone())
    ref.weight = nn.Parameter(new.clone())
    torch.testing.assert_close(ours(ids, offsets), ref(ids, offsets), rtol=0, atol=0)
    assert [name for name, _ in ours.named_parameters()] == ["weight"]
    with pytest.raises(TypeError, match="Parameter"):
        ours.weight = torch.zeros(12, 4)
    with pytest.raises(AssertionError):
        ours.weight = nn.Parameter(torch.zeros(11, 4))


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_weight_grad_in_id_space_and_torch_optimizers(backend, mode, sparse):
    if sparse and mode == "max":
        pytest.skip("nn.EmbeddingBag refuses max with sparse gradients")
    ref, ours = pair(mode=mode, sparse=sparse, padding_idx=2)
    make = (lambda p: torch.optim.SparseAdam(p, lr=0.05)) if sparse else (lambda p: torch.optim.Adam(p, lr=0.05))
    opt_ref, opt_ours = make(ref.parameters()), make(ours.parameters())
    for step in range(4):
        ids, offsets = batch(10 + step)
        g = torch.randn(4, 4)
        ref(ids, offsets).backward(g)
        ours(ids, offsets).backward(g)
        got, want = ours.weight.grad, ref.weight.grad
        assert got.is_sparse == sparse
        if sparse:  # nn's own sparse gradient: a row per non-padding lookup, uncoalesced, bit for bit
            assert not got.is_coalesced() and got._nnz() == int((ids != 2).sum())
            assert torch.equal(got._indices(), want._indices()) and torch.equal(got._values(), want._values())
        torch.testing.assert_close(got, want, rtol=0 if sparse else 1e-6, atol=0 if sparse else 1e-6)
        opt_ref.step()
        opt_ours.step()
        opt_ref.zero_grad()
        opt_ours.zero_grad()
        assert ours.weight.grad is None
    exact = 0 if sparse else None  # SparseAdam sees nn's gradient exactly
    torch.testing.assert_close(ours.weight, ref.weight, rtol=exact if sparse else 1e-5, atol=exact if sparse else 1e-6)


def test_backward_after_later_forwards_with_optimizer_none(backend):
    """Autograd allows several forwards before their backwards; the id-space gradient does not need the
    cache slots of the first forward."""
    ref, ours = pair(mode="sum")
    outs = []
    for seed in (20, 21, 22):
        ids, offsets = batch(seed)
        w = torch.rand(ids.numel(), requires_grad=True)
        outs.append((ref(ids, offsets, w), ours(ids, offsets, w.detach().clone().requires_grad_()), w))
    for r, o, _ in outs:
        r.sum().backward()
        o.sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------- dtypes
@pytest.mark.parametrize("target", [torch.float64, torch.float16, torch.bfloat16])
def test_dtype_conversions(backend, target):
    ref, ours = pair(mode="sum")
    ids, offsets = batch(5)
    ours(ids, offsets)
    converted = {torch.float64: ours.double, torch.float16: ours.half, torch.bfloat16: ours.bfloat16}[target]()
    assert converted is ours and ours.weight.dtype == target and ours.cache.rows.dtype == target
    ref = ref.to(target)
    out = ours(ids, offsets)
    assert out.dtype == target
    torch.testing.assert_close(out, ref(ids, offsets))
    ours.float()
    assert ours.weight.dtype == torch.float32
    torch.testing.assert_close(ours(ids, offsets), ref.float()(ids, offsets))


@pytest.mark.parametrize("optimizer", [None, "adagrad"])
def test_float64_table_trains_like_nn(backend, optimizer):
    torch.manual_seed(0)
    ref = nn.EmbeddingBag(12, 4, mode="mean", dtype=torch.float64, sparse=True)
    ours = cachedemb.CachedEmbeddingBag.from_pretrained(
        ref.weight.detach().clone(), freeze=False, mode="mean", sparse=True, cache_rows=3, device="cpu",
        optimizer=cachedemb.optim.Adagrad(lr=0.1) if optimizer else None)
    assert ours.cache.host_states.get("sum", torch.zeros(0, dtype=torch.float64)).dtype == torch.float64
    opt_ref = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    opt_ours = None if optimizer else torch.optim.Adagrad(ours.parameters(), lr=0.1)
    for step in range(3):
        ids, offsets = batch(30 + step)
        g = torch.randn(4, 4, dtype=torch.float64)
        ref(ids, offsets).backward(g)
        ours(ids, offsets).backward(g)
        opt_ref.step()
        opt_ref.zero_grad()
        if opt_ours:
            opt_ours.step()
            opt_ours.zero_grad()
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------- max_norm, scale_grad_by_freq
@pytest.mark.parametrize("optimizer", [None, "sgd"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_max_norm_renormalizes_looked_up_rows(backend, optimizer, norm_type):
    torch.manual_seed(0)
    table = torch.randn(12, 4) * 3
    ref = nn.EmbeddingBag.from_pretrained(table.clone(), freeze=False, max_norm=1.5, norm_type=norm_type,
                                          mode="sum")
    ours = cachedemb.CachedEmbeddingBag.from_pretrained(
        table.clone(), freeze=False, max_norm=1.5, norm_type=norm_type, mode="sum", cache_rows=2, device="cpu",
        optimizer=cachedemb.optim.SGD(lr=0.1) if optimizer else None)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_ours = None if optimizer else torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(3):
        ids, offsets = batch(40 + step)
        g = torch.randn(4, 4)
        a, b = ref(ids, offsets), ours(ids, offsets)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        a.backward(g)
        b.backward(g)
        opt_ref.step()
        opt_ref.zero_grad()
        if opt_ours:
            opt_ours.step()
            opt_ours.zero_grad()
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[torch.cat([batch(40 + s)[0] for s in range(3)])] = False
    assert torch.equal(ours.weight[untouched], table[untouched])  # only looked-up rows change


def brute_force_grad(table, ids, offsets, mode, g, psw=None, scale_by_freq=False):
    """d(sum(out * g))/d table in float64 from the definition: bag b pools ids[offsets[b]:offsets[b+1]]."""
    grad = torch.zeros(table.shape, dtype=torch.float64)
    counts = torch.bincount(ids, minlength=table.shape[0]).to(torch.float64)
    bounds = offsets.tolist() + [ids.numel()]
    for b in range(len(offsets)):
        lo, hi = bounds[b], bounds[b + 1]
        for j in range(lo, hi):
            i = int(ids[j])
            w = 1.0 / (hi - lo) if mode == "mean" else (float(psw[j]) if psw is not None else 1.0)
            grad[i] += w * g[b].to(torch.float64) / (counts[i] if scale_by_freq else 1.0)
    return grad


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_scale_grad_by_freq(backend, mode, weighted):
    torch.manual_seed(0)
    table = torch.randn(12, 4)
    ids, offsets = batch(50, lookups=14)
    ids[:5] = 3  # a hot id
    psw = torch.rand(ids.numel()) if weighted else None
    g = torch.randn(4, 4)
    ours = cachedemb.CachedEmbeddingBag.from_pretrained(table.clone(), freeze=False, mode=mode,
                                                        scale_grad_by_freq=True, cache_rows=2, device="cpu")
    ours(ids, offsets, psw).backward(g)
    want = brute_force_grad(table, ids, offsets, mode, g, psw, scale_by_freq=True)
    torch.testing.assert_close(ours.weight.grad.to(torch.float64), want, rtol=1e-6, atol=1e-6)
    # The fused optimizer applies the same scaled gradient.
    fused = cachedemb.CachedEmbeddingBag.from_pretrained(table.clone(), freeze=False, mode=mode,
                                                         scale_grad_by_freq=True, cache_rows=2, device="cpu",
                                                         optimizer=cachedemb.optim.SGD(lr=1.0))
    fused(ids, offsets, psw).backward(g)
    torch.testing.assert_close(fused.weight.to(torch.float64), table.to(torch.float64) - want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="max mode"):
        cachedemb.CachedEmbeddingBag(12, 4, mode="max", scale_grad_by_freq=True, device="cpu")(ids, offsets)


# ----------------------------------------------------------------- include_last_offset past offsets[-1]
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("validate", [True, False])
def test_include_last_offset_with_lookups_past_the_last_offset(backend, mode, padding_idx, validate, request):
    if backend == "triton" and not (validate and padding_idx is not None) and not request.config.getoption("--slow"):
        pytest.skip("slow: the interpreter repeats what the torch backend checks (input handling); --slow runs it")
    ref, ours = pair(mode=mode, padding_idx=padding_idx, include_last_offset=True)
    ours.validate_inputs = validate
    ids = torch.tensor([0, 1, 2, 3, 4, 3, 5, 6])
    for offsets in ([0, 2, 4], [0, 2, 2], [0, 3], [0, 1, 5], [0, 8]):
        o = torch.tensor(offsets)
        torch.testing.assert_close(ours(ids, o), ref(ids, o), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------- errors nn.EmbeddingBag code catches
@pytest.mark.parametrize("case,nn_type", [
    ("id_out_of_range", RuntimeError), ("offsets_not_starting_at_zero", RuntimeError),
    ("psw_outside_sum", NotImplementedError), ("psw_dtype", RuntimeError),
    ("padding_idx", AssertionError), ("max_sparse", ValueError), ("weight_shape", AssertionError),
])
def test_errors_are_caught_as_nn_embedding_bags(case, nn_type):
    def run(cls):
        if case == "padding_idx":
            return cls(5, 2, padding_idx=7)
        if case == "weight_shape":
            return cls(5, 2, _weight=torch.zeros(4, 2))
        kw = {"mode": "mean"} if case == "psw_outside_sum" else {"mode": "max", "sparse": True} if \
            case == "max_sparse" else {"mode": "sum"}
        m = cls(5, 2, **kw)
        ids = torch.tensor([1, 7] if case == "id_out_of_range" else [1, 2])
        offsets = torch.tensor([1] if case == "offsets_not_starting_at_zero" else [0])
        psw = None
        if case in ("psw_outside_sum", "psw_dtype"):
            psw = torch.ones(2, dtype=torch.float64 if case == "psw_dtype" else torch.float32)
        return m(ids, offsets, psw)

    with pytest.raises(nn_type):
        run(nn.EmbeddingBag)
    with pytest.raises(nn_type):
        run(lambda *a, **k: cachedemb.CachedEmbeddingBag(*a, cache_rows=1, device="cpu", **k))


def test_torchscript_is_refused_with_a_way_out():
    from cachedemb.modules.errors import NotScriptableError

    module = cachedemb.CachedEmbeddingBag(10, 2, cache_rows=2, device="cpu")
    with pytest.raises(NotScriptableError, match="to_embedding_bag"):
        torch.jit.script(nn.Sequential(module))
    scripted = torch.jit.script(module.to_embedding_bag())  # the suggested way works
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    torch.testing.assert_close(scripted(ids, offsets), module(ids, offsets))
