"""Code written for nn.EmbeddingBag touches `weight` in many ways; each idiom here runs on nn.EmbeddingBag and on
CachedEmbeddingBag side by side (same init, same batches, same optimizer) and the outputs are compared after the
idiom, through training steps after it, and the tables at the end. The ways that rebind the Parameter's storage
(`weight.data = t`, `weight.set_(t)`, `vector_to_parameters`, a dtype cast through `.data`) were silently ignored
before: the module kept reading the old table while the optimizer trained the new one. Also: integer arguments
as nn takes them (numpy integers, 0-d tensors), and the collection's `embedding_bags[t].weight` views."""
import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

import cachedemb
from cachedemb.modules.errors import InvalidWeightDtypeError, InvalidWeightShapeError, NegativeSizeError, NotAnIntegerError
from conftest import skip_triton_on_cpu_without_interpreter

pytestmark = [pytest.mark.usefixtures("sizing_mode")]

N, D = 50, 4
LR = 0.3


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    skip_triton_on_cpu_without_interpreter(request.param)
    monkeypatch.setenv("CACHEDEMB_BACKEND", request.param)
    return request.param


def table(seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def batch(seed: int, lookups: int = 24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N, (lookups,), generator=g), torch.tensor([0, 5, 5, 11, 20])


class Pair:
    """nn.EmbeddingBag and CachedEmbeddingBag on the same table, trained alike: `fused` trains ours with
    cachedemb.optim.SGD (the reference with torch.optim.SGD on its sparse gradient), else both with
    torch.optim.SGD over parameters()."""

    def __init__(self, fused: bool, cache_rows: int, sparse: bool = True, exact: bool = True):
        self.fused, self.cache_rows, self.exact = fused, cache_rows, exact and sparse and not fused
        self.ref = nn.EmbeddingBag(N, D, mode="sum", sparse=sparse, _weight=table(0))
        self.ours = cachedemb.CachedEmbeddingBag(N, D, mode="sum", sparse=sparse, cache_rows=cache_rows,
                                                 device="cpu", _weight=table(0), **self._optimizer())
        self.reset_optimizers()

    def _optimizer(self) -> dict:
        return {"optimizer": cachedemb.optim.SGD(lr=LR)} if self.fused else {}

    def reset_optimizers(self) -> None:
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=LR)
        self.ours_opt = None if self.fused else torch.optim.SGD(self.ours.parameters(), lr=LR)

    def modules(self):
        return (self.ref, self.ours)

    @property
    def tolerance(self) -> dict:
        """Bit-equal with torch.optim.SGD on sparse gradients (ours hands it nn's own); the fused SGD sums an id's
        lookups before stepping where torch's sparse SGD adds them one by one, and a dense gradient is summed per
        id before it is scattered: last-bit differences."""
        return dict(rtol=0, atol=0) if self.exact else dict(rtol=1e-6, atol=1e-6)

    def compare(self, seed: int) -> None:
        ids, offsets = batch(seed)
        with torch.no_grad():
            torch.testing.assert_close(self.ours(ids, offsets), self.ref(ids, offsets), **self.tolerance)

    def train(self, seeds) -> None:
        for seed in seeds:
            ids, offsets = batch(seed)
            grad = torch.randn(5, D, generator=torch.Generator().manual_seed(1000 + seed))
            for module, opt in ((self.ref, self.ref_opt), (self.ours, self.ours_opt)):
                out = module(ids, offsets)
                if module is self.ours:
                    torch.testing.assert_close(out, ref_out, **self.tolerance)
                ref_out = out.detach()
                out.backward(grad)
                if opt is not None:
                    opt.step()
                    opt.zero_grad()

    def assert_tables_equal(self) -> None:
        torch.testing.assert_close(self.ours.state_dict()["weight"], self.ref.weight.detach(), **self.tolerance)


def _rebind(attr_value):
    def idiom(pair: Pair):
        for m, t in zip(pair.modules(), (attr_value(), attr_value())):
            m.weight.data = t
    return idiom


def _set_(pair: Pair):
    for m in pair.modules():
        with torch.no_grad():
            m.weight.set_(table(7))


def _param_assign(pair: Pair):
    for m in pair.modules():
        m.weight = nn.Parameter(table(7), requires_grad=not pair.fused or m is pair.ref)
    pair.reset_optimizers()


def _vector_to_parameters(pair: Pair):
    # torch.nn.utils.vector_to_parameters rebinds each parameter: `param.data = vec[...].view_as(param).data`
    vec = table(7).reshape(-1)
    nn.utils.vector_to_parameters(vec.clone(), [pair.ref.weight])
    nn.utils.vector_to_parameters(vec.clone(), [pair.ours.weight])


def _in_place(write):
    def idiom(pair: Pair):
        for m in pair.modules():
            with torch.no_grad():
                write(m.weight)
    return idiom


def _apply_init(pair: Pair):
    def init(m):
        if hasattr(m, "weight"):
            nn.init.uniform_(m.weight, -0.05, 0.05)
    for m in pair.modules():
        torch.manual_seed(3)
        m.apply(init)


def _load_state_dict(pair: Pair):
    state = {"weight": table(7)}
    for m in pair.modules():
        m.load_state_dict(state, strict=False)


def _load_state_dict_assign(pair: Pair):
    for m in pair.modules():
        m.load_state_dict({"weight": table(7)}, strict=False, assign=True)
    pair.reset_optimizers()


def _requires_grad_off_on(pair: Pair):
    for m in pair.modules():
        m.requires_grad_(False)
    pair.compare(40)
    for m in pair.modules():
        m.requires_grad_(True)


def _deepcopy(pair: Pair):
    pair.ref, pair.ours = copy.deepcopy(pair.ref), copy.deepcopy(pair.ours)
    pair.reset_optimizers()


def _save_load_module(pair: Pair):
    copies = []
    for m in pair.modules():
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        copies.append(torch.load(buf, weights_only=False))
    pair.ref, pair.ours = copies
    pair.reset_optimizers()


def _clip_grad_then_step(pair: Pair):
    ids, offsets = batch(41)
    for m, opt in ((pair.ref, pair.ref_opt), (pair.ours, pair.ours_opt)):
        m(ids, offsets).sum().backward()
        if opt is not None:
            nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad()


def _share_memory(pair: Pair):
    for m in pair.modules():
        m.share_memory()


def _zero_grad(pair: Pair):
    ids, offsets = batch(42)
    for m in pair.modules():
        m(ids, offsets).sum().backward()
        m.zero_grad()


IDIOMS = {
    "data_assign": _rebind(lambda: table(7)),
    "data_assign_numpy": _rebind(lambda: torch.tensor(table(7).numpy(), requires_grad=True)),  # dlrm_s_pytorch
    "data_assign_noncontiguous": _rebind(lambda: table(7).t().contiguous().t()),
    "data_assign_float64": _rebind(lambda: table(7, torch.float64)),
    "data_assign_self_scaled": None,  # m.weight.data = m.weight.data * 2: the old values, through .data
    "set_": _set_,
    "parameter_assign": _param_assign,
    "vector_to_parameters": _vector_to_parameters,
    "data_copy_": _in_place(lambda w: w.data.copy_(table(7))),
    "data_uniform_": _in_place(lambda w: w.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(3))),
    "zero_": _in_place(lambda w: w.zero_()),
    "setitem": _in_place(lambda w: w.__setitem__(3, 1.5)),
    "nn_init_normal_": _in_place(lambda w: nn.init.normal_(w, generator=torch.Generator().manual_seed(3))),
    "apply_init": _apply_init,
    "load_state_dict": _load_state_dict,
    "load_state_dict_assign": _load_state_dict_assign,
    "requires_grad_off_on": _requires_grad_off_on,
    "deepcopy": _deepcopy,
    "torch_save_load_module": _save_load_module,
    "clip_grad_norm_then_step": _clip_grad_then_step,
    "share_memory": _share_memory,
    "zero_grad": _zero_grad,
}


def _self_scaled(pair: Pair):
    for m in pair.modules():
        m.weight.data = m.weight.data * 2


IDIOMS["data_assign_self_scaled"] = _self_scaled
FUSED_ONLY_TORCH = {"clip_grad_norm_then_step", "zero_grad", "requires_grad_off_on"}  # act on torch grads
REBINDING = {"data_assign", "data_assign_float64", "set_", "vector_to_parameters"}  # also under Triton
DENSE_GRAD = {"clip_grad_norm_then_step"}  # clip_grad_norm_ cannot take sparse gradients (nor with nn)
# nn.EmbeddingBag pools a non-contiguous table on its slow path, which rounds unlike its contiguous one; ours
# keeps a contiguous copy
NOT_BIT_EXACT = {"data_assign_noncontiguous"}


@pytest.mark.parametrize("when", ["before_forward", "after_training"])
@pytest.mark.parametrize("cache_rows", [3, N], ids=["cache3", "cache_all"])
@pytest.mark.parametrize("fused", [False, True], ids=["torch_sgd", "fused_sgd"])
@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_idiom_trains_as_nn_embedding_bag(backend, idiom, fused, cache_rows, when):
    if backend == "triton" and (cache_rows == N or when == "before_forward" or idiom not in REBINDING):
        pytest.skip("the interpreter repeats what the torch backend checks here (Python-side table handling)")
    if fused and idiom in FUSED_ONLY_TORCH:
        pytest.skip("acts on torch gradients, which the fused mode does not make")
    pair = Pair(fused, cache_rows, sparse=idiom not in DENSE_GRAD, exact=idiom not in NOT_BIT_EXACT)
    if when == "after_training":
        pair.train(range(3))
        pair.compare(10)
    IDIOMS[idiom](pair)
    pair.compare(11)
    pair.train(range(20, 24))
    pair.compare(12)
    pair.assert_tables_equal()


@pytest.mark.parametrize("fused", [False, True], ids=["torch_sgd", "fused_sgd"])
def test_rebinding_is_seen_by_every_entry_point(fused):
    """After `weight.data = t` the table is t for state_dict, load_state_dict, to_embedding_bag and prefetch
    admission as well as for forward: each adopts it before touching the table."""
    kw = {"optimizer": cachedemb.optim.SGD(lr=LR)} if fused else {}
    m = cachedemb.CachedEmbeddingBag(N, D, mode="sum", cache_rows=5, device="cpu", **kw)
    m(*batch(1)).sum().backward()
    m.weight.data = table(7)
    assert torch.equal(m.state_dict()["weight"], table(7))
    m.weight.data = table(8)
    assert torch.equal(m.to_embedding_bag().weight.detach(), table(8))
    m.weight.data = table(9)
    m.load_state_dict({"weight": table(10)}, strict=False)  # loads into the new table, not the old one
    ids, offsets = batch(2)
    ref = nn.EmbeddingBag.from_pretrained(table(10), mode="sum")
    torch.testing.assert_close(m(ids, offsets), ref(ids, offsets), rtol=0, atol=0)
    m.weight.data = table(11)
    batches = [batch(s) for s in range(3, 6)]
    ref = nn.EmbeddingBag.from_pretrained(table(11), mode="sum")
    with torch.no_grad():
        for ids, offsets in cachedemb.prefetch(batches, [m], depth=2, horizon=3):
            torch.testing.assert_close(m(ids, offsets), ref(ids, offsets), rtol=0, atol=0)


def test_rebinding_keeps_optimizer_state_per_id():
    """A fused Adagrad's per-id state survives `weight.data = t`, as torch.optim.Adagrad's state stays with its
    Parameter: training after the swap equals nn.EmbeddingBag + torch.optim.Adagrad doing the same."""
    ref = nn.EmbeddingBag(N, D, mode="sum", _weight=table(0))
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=LR)
    ours = cachedemb.CachedEmbeddingBag(N, D, mode="sum", cache_rows=4, device="cpu", _weight=table(0),
                                        optimizer=cachedemb.optim.Adagrad(lr=LR))
    for step in range(8):
        if step == 4:
            ref.weight.data = table(7)
            ours.weight.data = table(7)
        ids, offsets = batch(step)
        for m in (ref, ours):
            m(ids, offsets).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(ours.state_dict()["weight"], ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_rebinding_that_cannot_be_adopted_raises_and_changes_nothing():
    m = cachedemb.CachedEmbeddingBag(N, D, mode="sum", cache_rows=5, device="cpu",
                                     optimizer=cachedemb.optim.Adagrad(lr=LR))
    ids, offsets = batch(1)
    m(ids, offsets).sum().backward()
    before = m.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    good = m.weight.data
    for bad, error in ((torch.zeros(N - 1, D), InvalidWeightShapeError), (torch.zeros(N, D + 1), AssertionError),
                       (torch.zeros(N, D, dtype=torch.int64), InvalidWeightDtypeError),
                       (torch.zeros(N, D, dtype=torch.int64), RuntimeError)):  # nn's type for a long table
        m.weight.data = bad
        with pytest.raises(error, match="weight"):
            m(ids, offsets)
        m.weight.data = good  # the cache and the optimizer state were left as they were
        after = m.state_dict()
        for key, value in before.items():
            assert torch.equal(after[key], value), key


@pytest.mark.parametrize("value", [np.int64(N), np.int32(N), torch.tensor(N), torch.tensor([N])],
                         ids=["np.int64", "np.int32", "0-d tensor", "1-element tensor"])
def test_integer_arguments_as_nn_takes_them(value):
    ref = nn.EmbeddingBag(value, D, padding_idx=np.int64(2), mode="sum")
    ours = cachedemb.CachedEmbeddingBag(value, np.int64(D), padding_idx=np.int64(2), mode="sum",
                                        cache_rows=np.int64(4), device="cpu", _weight=ref.weight.detach().clone())
    assert (ours.num_embeddings, ours.embedding_dim, ours.padding_idx) == (N, D, 2)
    assert type(ours.num_embeddings) is int and ours.cache.capacity == 4
    ids, offsets = batch(3)
    torch.testing.assert_close(ours(ids, offsets), ref(ids, offsets), rtol=0, atol=0)
    config = cachedemb.TableConfig("t", np.int64(N), np.int32(D), ["f"])
    assert (config.num_embeddings, config.embedding_dim) == (N, D) and type(config.num_embeddings) is int


@pytest.mark.parametrize("num, dim", [(1.0 * N, D), ("50", D), (None, D), (True, D), (N, 4.0),
                                      (torch.tensor(5.0), D), (-1, D), (N, -2)])
def test_integer_arguments_nn_refuses_are_refused_with_its_type(num, dim):
    with pytest.raises(Exception) as nn_error:
        nn.EmbeddingBag(num, dim)
    with pytest.raises(type(nn_error.value), match="num_embeddings|embedding_dim") as ours_error:
        cachedemb.CachedEmbeddingBag(num, dim, device="cpu")
    assert isinstance(ours_error.value, (NotAnIntegerError, NegativeSizeError))


@pytest.mark.parametrize("padding_idx", [2.0, torch.tensor(2.0), "2"])
def test_non_integer_padding_idx_is_refused(padding_idx):
    with pytest.raises((TypeError, IndexError)):
        nn.EmbeddingBag(N, D, padding_idx=padding_idx)(*batch(1))
    with pytest.raises(NotAnIntegerError, match="padding_idx"):
        cachedemb.CachedEmbeddingBag(N, D, padding_idx=padding_idx, device="cpu")


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("num, dim", [(0, D), (N, 0)])
def test_empty_tables_as_nn(backend, num, dim, mode):
    """nn.EmbeddingBag takes zero rows or zero columns (and fails on some of them in forward or backward):
    ours gives its outputs, or raises its exception type."""
    ids = torch.tensor([], dtype=torch.int64) if num == 0 else torch.tensor([1, 2, 3])
    offsets = torch.tensor([0, 0]) if num == 0 else torch.tensor([0, 1])

    def run(module):
        out = module(ids, offsets)
        out.sum().backward()
        return out.detach()

    ours = cachedemb.CachedEmbeddingBag(num, dim, mode=mode, device="cpu", cache_rows=2)
    assert ours.state_dict()["weight"].shape == (num, dim)
    try:
        want = run(nn.EmbeddingBag(num, dim, mode=mode))
    except RuntimeError as error:
        with pytest.raises(type(error)):
            run(ours)
        return
    torch.testing.assert_close(run(ours), want, rtol=0, atol=0)


# ----------------------------------------------------------------- the collection's views
@pytest.mark.parametrize("fused", [False, True], ids=["torch_sgd", "fused_sgd"])
@pytest.mark.parametrize("how", ["data", "set_"])
def test_collection_view_rebinding_is_adopted(backend, fused, how):
    """`embedding_bags[t].weight.data = W` (torchrec code initializing its EBC's tables) replaces table t's
    rows; the group's other table is untouched; training goes on from W."""
    tables = [cachedemb.TableConfig("a", 20, D, ["fa"]), cachedemb.TableConfig("b", 30, D, ["fb"])]
    kw = {"optimizer": cachedemb.optim.SGD(lr=LR)} if fused else {}
    coll = cachedemb.CachedEmbeddingBagCollection(tables, device="cpu", cache_rows=6, **kw)
    feats = {"fa": (torch.tensor([1, 2, 3, 19]), torch.tensor([0, 1, 4])),
             "fb": (torch.tensor([4, 5, 29, 6]), torch.tensor([0, 2, 4]))}
    coll(feats)["fb"].sum().backward()
    a_before = coll.embedding_bags["a"].weight.detach().clone()
    W = torch.randn(30, D, generator=torch.Generator().manual_seed(5))
    if how == "data":
        coll.embedding_bags["b"].weight.data = W.clone()
    else:
        with torch.no_grad():
            coll.embedding_bags["b"].weight.set_(W.clone())
    ref_b = nn.EmbeddingBag.from_pretrained(W, mode="sum", include_last_offset=True)
    ref_a = nn.EmbeddingBag.from_pretrained(a_before, mode="sum", include_last_offset=True)
    out = coll(feats)
    torch.testing.assert_close(out["fb"], ref_b(*feats["fb"]), rtol=0, atol=0)
    torch.testing.assert_close(out["fa"], ref_a(*feats["fa"]), rtol=0, atol=0)
    assert torch.equal(coll.state_dict()["embedding_bags.b.weight"], W)
    with pytest.raises(InvalidWeightShapeError, match="'b'"):
        coll.embedding_bags["b"].weight.data = torch.zeros(29, D)
    assert torch.equal(coll.state_dict()["embedding_bags.b.weight"], W)


# ----------------------------------------------------------------- a real client
class _MiniDLRM(nn.Module):
    """Written the way facebookresearch/dlrm's dlrm_s_pytorch.py is: table sizes parsed with numpy, tables in
    a ModuleList built by a factory, each initialized by `EE.weight.data = torch.tensor(W, requires_grad=True)`
    from numpy uniform draws, a bottom MLP, dot interaction, a top MLP."""

    def __init__(self, make_bag, ln_emb: np.ndarray, m_spa: int, ln_bot: np.ndarray, seed: int):
        super().__init__()
        rng = np.random.RandomState(seed)
        self.emb_l = nn.ModuleList()
        for i in range(ln_emb.size):
            n = ln_emb[i]
            EE = make_bag(n, m_spa)
            W = rng.uniform(low=-np.sqrt(1 / n), high=np.sqrt(1 / n), size=(n, m_spa)).astype(np.float32)
            EE.weight.data = torch.tensor(W, requires_grad=True)
            self.emb_l.append(EE)
        layers = []
        for i in range(ln_bot.size - 1):
            lin = nn.Linear(int(ln_bot[i]), int(ln_bot[i + 1]))
            lin.weight.data = torch.tensor(rng.normal(0, np.sqrt(2 / (ln_bot[i] + ln_bot[i + 1])),
                                                      size=(ln_bot[i + 1], ln_bot[i])).astype(np.float32))
            lin.bias.data = torch.tensor(rng.normal(0, np.sqrt(1 / ln_bot[i + 1]), size=ln_bot[i + 1]).astype(np.float32))
            layers += [lin, nn.ReLU()]
        self.bot_l = nn.Sequential(*layers)
        n_int = ln_emb.size + 1
        self.top_l = nn.Linear(m_spa + n_int * (n_int - 1) // 2, 1)
        self.top_l.weight.data = torch.tensor(rng.normal(0, 0.1, size=(1, self.top_l.in_features)).astype(np.float32))
        self.top_l.bias.data.zero_()

    def forward(self, dense_x, lS_o, lS_i):
        x = self.bot_l(dense_x)
        ly = [self.emb_l[k](lS_i[k], lS_o[k]) for k in range(len(self.emb_l))]
        T = torch.cat([x] + ly, dim=1).view(x.shape[0], -1, x.shape[1])
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        li, lj = torch.tril_indices(T.shape[1], T.shape[1], offset=-1)
        return self.top_l(torch.cat([x, Z[:, li, lj]], dim=1)).squeeze(1)


def _dlrm_run(make_bag, sizes: str = "40-200-7-1000", steps: int = 12, batch_size: int = 32):
    ln_emb = np.fromstring(sizes, dtype=int, sep="-")  # as the script parses --arch-embedding-size
    ln_bot = np.fromstring("6-8-4", dtype=int, sep="-")
    model = _MiniDLRM(make_bag, ln_emb, 4, ln_bot, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    loss_fn = nn.BCEWithLogitsLoss()
    rng = np.random.RandomState(11)
    losses = []

    def data(n_batches):
        for _ in range(n_batches):
            dense = torch.tensor(rng.rand(batch_size, 6).astype(np.float32))
            lS_o = [torch.arange(0, 2 * batch_size, 2) for _ in ln_emb]
            lS_i = [torch.tensor(rng.zipf(1.3, 2 * batch_size) % n) for n in ln_emb]
            yield dense, lS_o, lS_i, torch.tensor(rng.randint(0, 2, batch_size).astype(np.float32))

    for dense, lS_o, lS_i, y in data(steps):
        loss = loss_fn(model(dense, lS_o, lS_i), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        model.eval()
        for dense, lS_o, lS_i, y in data(3):
            losses.append(loss_fn(model(dense, lS_o, lS_i), y).item())
    return losses, [bag.weight.detach().clone() for bag in model.emb_l]


def test_dlrm_style_client_trains_identically(backend):
    stock_losses, stock_tables = _dlrm_run(lambda n, m: nn.EmbeddingBag(n, m, mode="sum", sparse=True))
    ours_losses, ours_tables = _dlrm_run(
        lambda n, m: cachedemb.CachedEmbeddingBag(n, m, mode="sum", sparse=True, cache_ratio=0.05, device="cpu"))
    assert ours_losses == stock_losses  # bit for bit: the same gradients reach the same torch.optim.SGD
    for ours, stock in zip(ours_tables, stock_tables, strict=True):
        assert torch.equal(ours, stock)
