"""float64 tables through every op, and the per-unique-id gradient scale (`grad_scale_u`, scale_grad_by_freq), on
both backends, against brute-force float64 references that do not use the library's references: F.embedding_bag
on the full table (forward, and its autograd for the dense gradient and the per-sample-weight gradient) and the
optimizer rules written out over the full table.

Each case is a batch over a full table W [N, D] whose unique ids sit partly in cache slots (loc >= 0) and partly
on the host (HOST_LOC codes into a host table that is W itself), with padding lookups and empty bags. The Triton
backend runs under TRITON_INTERPRET=1 on CPU (conftest), or on the GPU with CUDA and no interpreter.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from cachedemb import kernels
from cachedemb.kernels import MODE_MAX, MODE_MEAN, MODE_SUM, UpdateRule, adam_step_size
from cachedemb.kernels.bag_backward import _bag_backward_triton
from cachedemb.kernels.sparse_update import _backward_update_triton

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1", allow_module_level=True)

BACKENDS = ["torch", "triton"]
MODES = {"sum": (MODE_SUM, False), "sum_psw": (MODE_SUM, True), "mean": (MODE_MEAN, False),
         "max": (MODE_MAX, False)}
MODE_NAMES = {MODE_SUM: "sum", MODE_MEAN: "mean", MODE_MAX: "max"}
RULES = {
    "sgd": UpdateRule("sgd", lr=0.1),
    "adagrad": UpdateRule("adagrad", lr=0.1, eps=1e-10),
    "rowwise_adagrad": UpdateRule("rowwise_adagrad", lr=0.1, eps=1e-8),
    "adam": UpdateRule("adam", lr=0.1, eps=1e-8, beta1=0.9, beta2=0.999, step_size=adam_step_size(0.1, 0.9, 0.999, 3)),
}
STATE_COLS = {"sgd": [], "adagrad": ["D"], "rowwise_adagrad": [1], "adam": ["D", "D"]}
TOL64 = 1e-12  # atol and rtol of every float64 comparison
DIMS = [7, 129]  # one D-block below 128, two D-blocks past it


def acc_dtype_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("CACHEDEMB_BACKEND", request.param)
    return request.param


class Case:
    """A batch over a full table `W [n_table, dim]`: `ids` / `offsets` / `psw` as nn.EmbeddingBag takes them
    (`pad` the padding id), and the cache's view of it: unique ids, `inverse` (-1 for padding), `loc_u`
    (a cache slot, or a host location code for every `host_every`-th unique id; -1 past n), cache `rows`
    (NaN where no live id sits) and `host_rows` (W itself)."""

    def __init__(self, dim, dtype=torch.float64, *, lengths=(0, 3, 1, 0, 9, 30, 2, 5), n_ids=14, pad=5,
                 n_table=40, n_slots=48, host_every=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.dim, self.dtype, self.pad = dim, dtype, pad
        lengths = torch.tensor(lengths, dtype=torch.int64)
        n_lookups = int(lengths.sum())
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.ids = torch.randint(0, n_ids, (n_lookups,), generator=g)
        self.W = torch.randn(n_table, dim, generator=g, dtype=torch.float64).to(dtype)
        self.psw = (torch.rand(n_lookups, generator=g, dtype=torch.float64) + 0.5).to(dtype)
        self.grad_out = torch.randn(len(lengths), dim, generator=g, dtype=torch.float64).to(dtype)
        uniq, self.inverse, self.counts, self.n_uniq = kernels.unique_ids_torch(self.ids, padding_idx=pad)
        self.n = n = int(self.n_uniq)
        self.uniq = uniq[:n]
        self.on_host = (torch.arange(n) % host_every == host_every - 1) if host_every else torch.zeros(n) > 0
        self.slots = torch.randperm(n_slots, generator=g)[:n]
        loc = torch.where(self.on_host, kernels.host_loc(self.uniq), self.slots)
        self.loc_u = torch.full((n_lookups,), -1, dtype=torch.int64)
        self.loc_u[:n] = loc
        self.rows = torch.full((n_slots, dim), float("nan"), dtype=dtype)
        self.rows[self.slots[~self.on_host]] = self.W[self.uniq[~self.on_host]]
        self.host_rows = self.W.clone()
        self.gen = g

    def to(self, device):
        for name in ("offsets", "ids", "psw", "grad_out", "inverse", "counts", "n_uniq", "loc_u", "rows"):
            setattr(self, name, getattr(self, name).to(device))
        if device != "cpu":
            self.host_rows = self.host_rows.pin_memory()
        return self

    # brute-force references on the full table, in float64
    def embedding_bag(self, mode, use_psw, need_grads=False):
        """(out, dense gradient of W, gradient of psw) of F.embedding_bag on W with loss <out, grad_out>."""
        W = self.W.double().clone().requires_grad_(need_grads)
        psw = self.psw.double().cpu().clone().requires_grad_(need_grads) if use_psw else None
        out = F.embedding_bag(self.ids.cpu(), W, self.offsets[:-1].cpu(), mode=MODE_NAMES[mode],
                              per_sample_weights=psw, padding_idx=self.pad)
        if not need_grads:
            return out.detach(), None, None
        (out * self.grad_out.double().cpu()).sum().backward()
        return out.detach(), W.grad, psw.grad if use_psw else None

    def id_counts(self):
        """Occurrences of each table id in the whole input (padding lookups excluded)."""
        valid = self.ids.cpu() != self.pad
        return torch.bincount(self.ids.cpu()[valid], minlength=self.W.shape[0]).double()

    def grad_scale_u(self, dtype=torch.float64):
        """1 / count for each live unique position, NaN past n (never read)."""
        scale = torch.full((self.inverse.numel(),), float("nan"), dtype=dtype)
        scale[: self.n] = (1.0 / self.counts[: self.n].cpu().double()).to(dtype)
        return scale.to(self.inverse.device)


def assert_close(actual, expected, atol=TOL64, rtol=TOL64, what=""):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    same_nan = actual.isnan() & expected.isnan()
    diff = (actual - expected).abs()
    bad = ~same_nan & ~(diff <= atol + rtol * expected.abs())
    if bool(bad.any()):
        where = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} differ, max |diff| "
                             f"{float(diff[bad].max()):.3g}, first at {where}: {actual[bad][:5].tolist()} vs "
                             f"{expected[bad][:5].tolist()}")


def max_pos_of(c, mode):
    """max_pos as the forward computes it (the reference forward: the op under test is the backward)."""
    if mode != MODE_MAX:
        return None
    return kernels.pooled_forward_torch(c.rows, c.loc_u, c.inverse, c.offsets, mode, None, c.host_rows)[1]


# ----------------------------------------------------------------- float64: forward and gradients
@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
@pytest.mark.parametrize("mode_name", list(MODES))
def test_fp64_pooled_forward(backend, mode_name, dim):
    mode, use_psw = MODES[mode_name]
    c = Case(dim).to(DEVICE)
    out, max_pos = kernels.pooled_forward(c.rows, c.loc_u, c.inverse, c.offsets, mode,
                                          c.psw if use_psw else None, c.host_rows)
    expected, _, _ = c.embedding_bag(mode, use_psw)
    assert out.dtype == torch.float64
    assert_close(out, expected, what="fp64 pooled forward")
    if mode == MODE_MAX:
        # every element is a copy of the row element at the lookup max_pos names; -1 for bags without lookups
        max_pos = max_pos.cpu()
        lengths = (c.offsets[1:] - c.offsets[:-1]).cpu()
        empty = lengths == 0
        assert (max_pos[empty] == -1).all()
        picked = c.W[c.ids.cpu()[max_pos[~empty].clamp(min=0)], torch.arange(dim)]
        assert torch.equal(out.cpu()[~empty], picked)
        assert (c.ids.cpu()[max_pos[~empty]] != c.pad).all()
    else:
        assert max_pos is None


@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
@pytest.mark.parametrize("mode_name", list(MODES))
def test_fp64_bag_backward(backend, mode_name, dim):
    mode, use_psw = MODES[mode_name]
    c = Case(dim).to(DEVICE)
    args = (c.grad_out, c.inverse, c.offsets, mode, c.psw if use_psw else None, max_pos_of(c, mode))
    grad_u = kernels.bag_backward(*args)
    _, dense, _ = c.embedding_bag(mode, use_psw, need_grads=True)
    assert grad_u.dtype == torch.float64 and grad_u.shape == (c.inverse.numel(), dim)
    assert_close(grad_u[: c.n], dense[c.uniq], what="fp64 grad_u")
    assert (grad_u[c.n:] == 0).all()
    bounded = kernels.bag_backward(*args, n_rows=c.n)
    assert bounded.shape == (c.n, dim)
    assert_close(bounded, dense[c.uniq], what="fp64 grad_u, n_rows")
    if backend == "triton":  # the GPU's tiled, Kahan-compensated reduction
        assert_close(_bag_backward_triton(*args, block_l=16), grad_u, what="fp64 grad_u, block_l=16")


@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
def test_fp64_per_sample_weights_grad(backend, dim):
    c = Case(dim).to(DEVICE)
    got = kernels.per_sample_weights_grad(c.grad_out, c.rows, c.loc_u, c.inverse, c.offsets, c.host_rows)
    _, _, expected = c.embedding_bag(MODE_SUM, True, need_grads=True)
    assert got.dtype == torch.float64
    assert_close(got, expected, what="fp64 per-sample-weight gradient")


# ----------------------------------------------------------------- float64: optimizer updates
def make_states(c, rule_name, dtype=torch.float64):
    """Per-id states over the full table (`full`, the reference's), and the cache's copies: `cache` (the slots of
    cache-served ids hold their id's state, the rest NaN) and `host` (the full table's, for host-served ids)."""
    cols = [c.dim if k == "D" else k for k in STATE_COLS[rule_name]]
    full = [torch.rand(c.W.shape[0], k, generator=c.gen, dtype=torch.float64).to(dtype) for k in cols]
    cache = []
    for s in full:
        t = torch.full((c.rows.shape[0], s.shape[1]), float("nan"), dtype=dtype)
        t[c.slots[~c.on_host]] = s[c.uniq[~c.on_host]]
        cache.append(t.to(DEVICE))
    host = [s.clone() for s in full]
    if DEVICE != "cpu":
        host = [s.pin_memory() for s in host]
    return full, cache, host


def brute_update(W, states, ids, G, rule):
    """The rule over the full table in float64 (the textbook formulas, not the kernels' order): rows `ids` step
    with their gradient rows G[ids]."""
    W, states = W.double().clone(), [s.double().clone() for s in states]
    g = G[ids]
    if rule.kind == "sgd":
        W[ids] -= rule.lr * g
    elif rule.kind == "adagrad":
        states[0][ids] += g * g
        W[ids] -= rule.lr * g / (states[0][ids].sqrt() + rule.eps)
    elif rule.kind == "rowwise_adagrad":
        states[0][ids] += (g * g).mean(1, keepdim=True)
        W[ids] -= rule.lr * g / (states[0][ids].sqrt() + rule.eps)
    else:
        m, v = states
        m[ids] = rule.beta1 * m[ids] + (1 - rule.beta1) * g
        v[ids] = rule.beta2 * v[ids] + (1 - rule.beta2) * g * g
        W[ids] -= rule.step_size * m[ids] / (v[ids].sqrt() + rule.eps)
    return W, states


def host_expected(c, ref, before):
    """The host table after the step: the reference's rows for host-served ids, its rows before for the
    cache-served ones (their update lands in the cache), unchanged elsewhere (equal in both)."""
    expected = ref.clone()
    cache_ids = c.uniq[~c.on_host]
    expected[cache_ids] = before[cache_ids].to(expected.dtype)
    return expected


def check_updated(c, rows, cache_states, host_rows, host_states, W_ref, states_ref, full_states0,
                  atol=TOL64, rtol=TOL64):
    """Cache-served ids: their slot's row and states; host-served ids: their host row and states; every other
    slot and host row untouched (`full_states0`: the full-table states before the step)."""
    cache_ids, cache_slots = c.uniq[~c.on_host], c.slots[~c.on_host]
    rows, host_rows = rows.cpu(), host_rows.cpu()
    assert_close(rows[cache_slots], W_ref[cache_ids], atol, rtol, "cache rows")
    assert_close(host_rows, host_expected(c, W_ref, c.W), atol, rtol, "host rows")
    for s, s_host, ref, s0 in zip(cache_states, host_states, states_ref, full_states0):
        assert_close(s.cpu()[cache_slots], ref[cache_ids], atol, rtol, "cache states")
        assert_close(s_host.cpu(), host_expected(c, ref, s0), atol, rtol, "host states")
    others = torch.ones(rows.shape[0], dtype=torch.bool)
    others[cache_slots] = False
    assert rows[others].isnan().all()
    for s in cache_states:
        assert s.cpu()[others].isnan().all()


@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
@pytest.mark.parametrize("mode_name", list(MODES))
@pytest.mark.parametrize("rule_name", list(RULES))
def test_fp64_backward_update(backend, rule_name, mode_name, dim):
    rule = RULES[rule_name]
    mode, use_psw = MODES[mode_name]
    c = Case(dim, seed=1).to(DEVICE)
    full, cache_states, host_states = make_states(c, rule_name)
    _, dense, _ = c.embedding_bag(mode, use_psw, need_grads=True)
    kernels.backward_update(c.rows, cache_states, c.loc_u, c.n_uniq, c.grad_out, c.inverse, c.offsets, mode,
                            c.psw if use_psw else None, max_pos_of(c, mode), rule, c.host_rows, host_states)
    W_ref, states_ref = brute_update(c.W, full, c.uniq, dense, rule)
    check_updated(c, c.rows, cache_states, c.host_rows, host_states, W_ref, states_ref, full)


@pytest.mark.parametrize("rule_name", list(RULES))
def test_fp64_backward_update_tiled(rule_name):
    """The GPU's tiled reduction (block_l = 16, Kahan-compensated in fp64) over a duplicate-heavy batch."""
    rule = RULES[rule_name]
    c = Case(60, lengths=(300, 0, 60, 40), n_ids=4, pad=3, seed=3).to(DEVICE)
    full, cache_states, host_states = make_states(c, rule_name)
    _, dense, _ = c.embedding_bag(MODE_SUM, True, need_grads=True)
    _backward_update_triton(c.rows, cache_states, c.loc_u, c.n_uniq, c.grad_out, c.inverse, c.offsets, MODE_SUM,
                            c.psw, None, rule, block_l=16, host_rows=c.host_rows, host_states=host_states)
    W_ref, states_ref = brute_update(c.W, full, c.uniq, dense, rule)
    check_updated(c, c.rows, cache_states, c.host_rows, host_states, W_ref, states_ref, full)


@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
@pytest.mark.parametrize("rule_name", list(RULES))
def test_fp64_sparse_update(backend, rule_name, dim):
    rule = RULES[rule_name]
    c = Case(dim, host_every=0, seed=2).to(DEVICE)
    full, cache_states, _ = make_states(c, rule_name)
    grad_u = torch.full((c.inverse.numel(), dim), float("nan"), dtype=torch.float64)
    dense = torch.zeros_like(c.W)
    dense[c.uniq] = torch.randn(c.n, dim, generator=c.gen, dtype=torch.float64)
    grad_u[: c.n] = dense[c.uniq]
    kernels.sparse_update(c.rows, cache_states, c.loc_u, grad_u.to(DEVICE), c.n_uniq, rule)
    W_ref, states_ref = brute_update(c.W, full, c.uniq, dense, rule)
    # no host-served ids: the host table stands for the reference itself
    check_updated(c, c.rows, cache_states, c.W, full, W_ref, states_ref, full)


@pytest.mark.parametrize("rule_name", ["adagrad", "adam"])
def test_fp64_table_with_fp32_states(backend, rule_name):
    """fp32 optimizer states beside an fp64 table: the update math runs in fp64, the states are stored rounded."""
    rule = RULES[rule_name]
    c = Case(7, seed=4).to(DEVICE)
    full, cache_states, host_states = make_states(c, rule_name, dtype=torch.float32)
    _, dense, _ = c.embedding_bag(MODE_MEAN, False, need_grads=True)
    kernels.backward_update(c.rows, cache_states, c.loc_u, c.n_uniq, c.grad_out, c.inverse, c.offsets, MODE_MEAN,
                            None, None, rule, c.host_rows, host_states)
    assert c.rows.dtype == torch.float64 and all(s.dtype == torch.float32 for s in cache_states)
    W_ref, states_ref = brute_update(c.W, full, c.uniq, dense, rule)
    cache_ids, cache_slots = c.uniq[~c.on_host], c.slots[~c.on_host]
    assert_close(c.rows.cpu()[cache_slots], W_ref[cache_ids], what="rows")
    assert_close(c.host_rows.cpu(), host_expected(c, W_ref, c.W), what="host rows")
    for s, s_host, ref, s0 in zip(cache_states, host_states, states_ref, full):
        assert_close(s.cpu()[cache_slots], ref[cache_ids], 0, 2**-23, "cache states")  # one fp32 rounding
        assert_close(s_host.cpu(), host_expected(c, ref, s0), 0, 2**-23, "host states")
    if backend == "torch":
        return  # the reference takes any float states
    with pytest.raises(ValueError, match="optimizer states"):
        kernels.backward_update(c.rows, [s.half() for s in cache_states], c.loc_u, c.n_uniq, c.grad_out, c.inverse,
                                c.offsets, MODE_MEAN, None, None, rule, c.host_rows, host_states)


# ----------------------------------------------------------------- float64: row_copy
@pytest.mark.parametrize("impl", ["dispatch", "staged"])
@pytest.mark.parametrize("cols", [None, 1, 37, 300])
def test_fp64_row_copy(backend, impl, cols):
    """fp64 rows copied bit for bit (full-precision values, NaN destinations that nobody copies stay NaN), and
    accumulated."""
    from cachedemb.kernels.row_copy import row_copy_staged

    g = torch.Generator().manual_seed(cols or 0)
    n_src, cap = 90, 40
    shape = (n_src,) if cols is None else (n_src, cols)
    src = torch.randn(shape, generator=g, dtype=torch.float64) * 1e3 + 1 / 3
    dst = torch.full(((n_src + 7),) + shape[1:], float("nan"), dtype=torch.float64)
    src_idx = torch.randint(-1, n_src, (cap,), generator=g)
    dst_idx = torch.randperm(n_src + 7, generator=g)[:cap]
    dst_idx[::5] = -1
    n = torch.tensor([cap - 3])
    src, dst, src_idx, dst_idx, n = (t.to(DEVICE) for t in (src, dst, src_idx, dst_idx, n))
    copy = kernels.row_copy if impl == "dispatch" else row_copy_staged
    copy(src, src_idx, dst, dst_idx, n)
    expected = torch.full_like(dst.cpu(), float("nan"))
    for i in range(cap - 3):
        s, d = int(src_idx[i]), int(dst_idx[i])
        if s >= 0 and d >= 0:
            expected[d] = src.cpu()[s]
    got = dst.cpu()
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())
    acc = torch.zeros_like(dst)
    copy(src, src_idx, acc, dst_idx, n, accumulate=True)
    copy(src, src_idx, acc, dst_idx, n, accumulate=True)
    assert torch.equal(acc.cpu(), 2 * expected.nan_to_num())


# ----------------------------------------------------------------- grad_scale_u (scale_grad_by_freq)
GS_DTYPES = [pytest.param(torch.float64, TOL64, id="fp64"), pytest.param(torch.float32, 2e-6, id="fp32")]


@pytest.mark.parametrize("dtype,tol", GS_DTYPES)
@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
@pytest.mark.parametrize("mode_name", list(MODES))
def test_grad_scale_bag_backward(backend, mode_name, dim, dtype, tol):
    """grad_scale_u = 1 / count: nn.Embedding's scale_grad_by_freq (each id's gradient divided by its
    occurrences in the whole input), judged against the dense float64 gradient divided by the counts."""
    mode, use_psw = MODES[mode_name]
    c = Case(dim, dtype, seed=5).to(DEVICE)
    args = (c.grad_out, c.inverse, c.offsets, mode, c.psw if use_psw else None, max_pos_of(c, mode))
    _, dense, _ = c.embedding_bag(mode, use_psw, need_grads=True)
    expected = dense / c.id_counts().clamp(min=1).unsqueeze(1)
    scale = c.grad_scale_u(dtype)
    grad_u = kernels.bag_backward(*args, grad_scale_u=scale)
    assert grad_u.dtype == acc_dtype_of(dtype)
    assert_close(grad_u[: c.n], expected[c.uniq], tol, tol, "scaled grad_u")
    assert (grad_u[c.n:] == 0).all()  # the NaN factors past n are never read
    assert_close(kernels.bag_backward(*args, n_rows=c.n, grad_scale_u=scale), expected[c.uniq], tol, tol,
                 "scaled grad_u, n_rows")
    # the scale is a multiply on the summed gradient and nothing else: ones give today's result bit for bit
    # (the torch reference on CUDA sums with atomics, whose order varies run to run: there, to the rounding)
    ones = torch.ones_like(scale)
    unscaled, scaled_by_ones = kernels.bag_backward(*args), kernels.bag_backward(*args, grad_scale_u=ones)
    if backend == "torch" and unscaled.is_cuda:
        assert_close(scaled_by_ones, unscaled, tol, tol, "grad_u scaled by ones")
    else:
        assert torch.equal(scaled_by_ones, unscaled)
    if backend == "triton":
        assert_close(_bag_backward_triton(*args, block_l=16, grad_scale_u=scale)[: c.n], expected[c.uniq], tol,
                     tol, "scaled grad_u, block_l=16")


@pytest.mark.parametrize("dtype,tol", GS_DTYPES)
@pytest.mark.parametrize("mode_name", list(MODES))
@pytest.mark.parametrize("rule_name", list(RULES))
def test_grad_scale_backward_update(backend, rule_name, mode_name, dtype, tol):
    """The scaled gradient is what the rule (and Adagrad's / Adam's state) sees."""
    rule = RULES[rule_name]
    mode, use_psw = MODES[mode_name]
    dim = 129 if rule_name == "rowwise_adagrad" else 7  # row-wise's mean of g^2 over two D-blocks
    c = Case(dim, dtype, seed=6).to(DEVICE)
    full, cache_states, host_states = make_states(c, rule_name, acc_dtype_of(dtype))
    _, dense, _ = c.embedding_bag(mode, use_psw, need_grads=True)
    dense = dense / c.id_counts().clamp(min=1).unsqueeze(1)
    kernels.backward_update(c.rows, cache_states, c.loc_u, c.n_uniq, c.grad_out, c.inverse, c.offsets, mode,
                            c.psw if use_psw else None, max_pos_of(c, mode), rule, c.host_rows, host_states,
                            grad_scale_u=c.grad_scale_u(dtype))
    W_ref, states_ref = brute_update(c.W, full, c.uniq, dense, rule)
    check_updated(c, c.rows, cache_states, c.host_rows, host_states, W_ref, states_ref, full,
                  tol, tol)


def test_grad_scale_backward_update_tiled():
    """The GPU's tiled reduction with the scale, Adam in fp32 (so the scaled gradient enters both states)."""
    rule = RULES["adam"]
    c = Case(60, torch.float32, lengths=(300, 0, 60, 40), n_ids=4, pad=3, seed=7).to(DEVICE)
    full, cache_states, host_states = make_states(c, "adam", torch.float32)
    _, dense, _ = c.embedding_bag(MODE_SUM, True, need_grads=True)
    dense = dense / c.id_counts().clamp(min=1).unsqueeze(1)
    _backward_update_triton(c.rows, cache_states, c.loc_u, c.n_uniq, c.grad_out, c.inverse, c.offsets, MODE_SUM,
                            c.psw, None, rule, block_l=16, host_rows=c.host_rows, host_states=host_states,
                            grad_scale_u=c.grad_scale_u(torch.float32))
    W_ref, states_ref = brute_update(c.W, full, c.uniq, dense, rule)
    check_updated(c, c.rows, cache_states, c.host_rows, host_states, W_ref, states_ref, full,
                  2e-6, 2e-6)


def test_grad_scale_none_is_todays_result(backend):
    """grad_scale_u=None leaves the fused update exactly as without the argument (fp32, every mode)."""
    rule = RULES["adagrad"]
    for mode_name, (mode, use_psw) in MODES.items():
        results = []
        for kwargs in ({}, {"grad_scale_u": None}):
            c = Case(7, torch.float32, seed=8).to(DEVICE)
            _, cache_states, host_states = make_states(c, "adagrad", torch.float32)
            kernels.backward_update(c.rows, cache_states, c.loc_u, c.n_uniq, c.grad_out, c.inverse, c.offsets,
                                    mode, c.psw if use_psw else None, max_pos_of(c, mode), rule, c.host_rows,
                                    host_states, **kwargs)
            results.append((c.rows.cpu(), c.host_rows.cpu(), [s.cpu() for s in cache_states + host_states]))
        (r0, h0, s0), (r1, h1, s1) = results
        if backend == "torch" and DEVICE == "cuda":  # the torch reference's CUDA atomics: equal to the rounding
            for a, b in [(r0, r1), (h0, h1), *zip(s0, s1)]:
                assert_close(b.nan_to_num(), a.nan_to_num(), 2e-6, 2e-6, mode_name)
        else:
            assert torch.equal(r0.nan_to_num(), r1.nan_to_num()) and torch.equal(h0, h1), mode_name
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(s0, s1)), mode_name

