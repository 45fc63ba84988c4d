"""Triton pooled forward, bag backward and (fused) sparse update vs their references.

On CPU the kernels run under the Triton interpreter; inputs stay small. Tolerances, as (dtype, atol, rtol):
forward and backward sums are bitwise equal (same sequential fp32 order, same round-to-nearest-even cast);
updates differ from torch by an ulp (torch's CPU add uses FMA, its mean reduces in another order).
"""
import os

import pytest
import torch

from cachedemb import kernels
from cachedemb.kernels import MODE_MAX, MODE_MEAN, MODE_SUM, UpdateRule, adam_step_size
from cachedemb.kernels.bag_backward import _bag_backward_triton, bag_backward_triton
from cachedemb.kernels.pooled_forward import pooled_forward_triton
from cachedemb.kernels.sparse_update import (
    _backward_update_triton,
    backward_update_triton,
    sparse_update_triton,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture(autouse=True)
def cpu_cases_need_the_interpreter(request):
    """CPU-tensor cases launch Triton under the interpreter; on a CUDA machine (no interpreter) only the
    test_cuda_* cases run."""
    if not INTERPRETED and not request.node.name.startswith("test_cuda"):
        pytest.skip("CPU cases run the Triton kernels under TRITON_INTERPRET=1")


DIMS = [1, 7, 60, 129]
MODES = {"sum": (MODE_SUM, False), "sum_psw": (MODE_SUM, True), "mean": (MODE_MEAN, False),
         "max": (MODE_MAX, False)}
RULES = {
    "sgd": UpdateRule("sgd", lr=0.1),
    "adagrad": UpdateRule("adagrad", lr=0.1, eps=1e-10),
    "rowwise_adagrad": UpdateRule("rowwise_adagrad", lr=0.1, eps=1e-8),
    "adam": UpdateRule("adam", lr=0.1, eps=1e-8, beta1=0.9, beta2=0.999, step_size=adam_step_size(0.1, 0.9, 0.999, 3)),
}
# rows dtype -> (atol, rtol) for updated rows; states are fp32 and use the fp32 row.
UPDATE_TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (8e-3, 8e-3)}


def make_batch(dim, dtype=torch.float32, *, n_ids=12, lengths=(0, 3, 1, 0, 9, 30, 2, 0), pad_id=5, n_rows=64,
               n_bags_grad=None, seed=0):
    """A batch through the reference unique op: bag lengths `lengths`, ids drawn from n_ids (duplicate-heavy),
    id `pad_id` a padding lookup (inverse -1). Rows not referenced by loc_u hold NaN (must never be read)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    n_lookups = int(lengths.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, n_ids, (n_lookups,), generator=g)
    uniq, inverse, counts, n_uniq = kernels.unique_ids_torch(ids, padding_idx=pad_id)
    n = int(n_uniq)
    loc_u = torch.full((n_lookups,), -1, dtype=torch.int64)
    loc_u[:n] = torch.randperm(n_rows, generator=g)[:n]
    rows = torch.full((n_rows, dim), float("nan"), dtype=dtype)
    rows[loc_u[:n]] = torch.randn(n, dim, generator=g).to(dtype)
    psw = torch.rand(n_lookups, generator=g) + 0.5
    grad_out = torch.randn(len(lengths), dim, generator=g)
    return dict(rows=rows, loc_u=loc_u, inverse=inverse, offsets=offsets, n_uniq=n_uniq, psw=psw,
                grad_out=grad_out)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_close(actual, expected, atol, rtol, what):
    diff = (actual.float() - expected.float()).abs()
    bad = diff > atol + rtol * expected.float().abs()
    if bad.any():
        where = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} elements differ, max |diff| {diff.max().item():.3g}, "
                             f"first at {where}: {actual[bad][:5].tolist()} vs {expected[bad][:5].tolist()}")


# ----------------------------------------------------------------- pooled forward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
@pytest.mark.parametrize("mode_name", list(MODES))
def test_pooled_forward(mode_name, dim, dtype):
    mode, use_psw = MODES[mode_name]
    b = make_batch(dim, dtype)
    args = (b["rows"], b["loc_u"], b["inverse"], b["offsets"], mode, b["psw"] if use_psw else None)
    out, max_pos = pooled_forward_triton(*args)
    ref_out, ref_pos = kernels.pooled_forward_torch(*args)
    assert out.dtype == dtype and out.shape == ref_out.shape
    if mode == MODE_MAX or dtype != torch.float32:
        # max is a copy; half precision rows go through the reference's fp32 gather path: bit-exact.
        assert torch.equal(bits(out), bits(ref_out)), (out - ref_out).abs().max()
    else:
        # The fp32 reference pools in place with torch.embedding_bag (vectorized, may fuse multiply-adds).
        assert_close(out, ref_out, 1e-6, 1e-6, "fp32 pooled sum/mean")
    if mode == MODE_MAX:
        assert torch.equal(max_pos, ref_pos)
        assert (max_pos[[0, 3, 7]] == -1).all() and (out[[0, 3, 7]] == 0).all()
    else:
        assert max_pos is None


@pytest.mark.parametrize("mode_name", ["sum", "mean", "max"])
def test_pooled_forward_fp16_ties_long_bag(mode_name):
    """fp16 rows, one 1500-lookup bag over 3 ids (many exact ties for max), an all-padding bag."""
    mode, _ = MODES[mode_name]
    b = make_batch(60, torch.float16, n_ids=4, lengths=(1500, 0, 4, 2), pad_id=0, seed=1)
    args = (b["rows"], b["loc_u"], b["inverse"], b["offsets"], mode, None)
    out, max_pos = pooled_forward_triton(*args)
    ref_out, ref_pos = kernels.pooled_forward_torch(*args)
    assert torch.equal(bits(out), bits(ref_out))
    if mode == MODE_MAX:
        assert torch.equal(max_pos, ref_pos)


def test_pooled_forward_no_bags_no_lookups():
    rows = torch.randn(4, 7)
    empty = torch.zeros(0, dtype=torch.int64)
    out, max_pos = pooled_forward_triton(rows, empty, empty, torch.zeros(1, dtype=torch.int64), MODE_MAX)
    assert out.shape == (0, 7) and max_pos.shape == (0, 7)
    out, _ = pooled_forward_triton(rows, empty, empty, torch.zeros(3, dtype=torch.int64), MODE_MEAN)
    assert torch.equal(out, torch.zeros(2, 7))


# ----------------------------------------------------------------- bag backward
@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
@pytest.mark.parametrize("mode_name", list(MODES))
def test_bag_backward(mode_name, dim):
    mode, use_psw = MODES[mode_name]
    b = make_batch(dim)
    _, max_pos = kernels.pooled_forward_torch(b["rows"], b["loc_u"], b["inverse"], b["offsets"], mode)
    args = (b["grad_out"], b["inverse"], b["offsets"], mode, b["psw"] if use_psw else None, max_pos)
    ref = kernels.bag_backward_torch(*args)
    got = bag_backward_triton(*args)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(got, ref), (got - ref).abs().max()
    assert (got[int(b["n_uniq"]):] == 0).all()
    # tiled lookups (the GPU setting): another fp32 summation order
    assert_close(_bag_backward_triton(*args, block_l=8), ref, 1e-5, 1e-5, "block_l=8")


def test_bag_backward_dispatch(monkeypatch):
    b = make_batch(7)
    args = (b["grad_out"], b["inverse"], b["offsets"], MODE_MEAN, None, None)
    monkeypatch.setenv("CACHEDEMB_BACKEND", "triton")
    assert torch.equal(kernels.bag_backward(*args), kernels.bag_backward_torch(*args))
    assert bag_backward_triton(torch.zeros(0, 7), *[torch.zeros(n, dtype=torch.int64) for n in (0, 1)],
                               MODE_SUM).shape == (0, 7)
    with pytest.raises(ValueError, match="max_pos"):
        bag_backward_triton(*args[:3], MODE_MAX)


# ----------------------------------------------------------------- sparse update
def make_states(rule, n_rows, dim, seed=2):
    g = torch.Generator().manual_seed(seed)
    cols = {"sgd": [], "adagrad": [dim], "rowwise_adagrad": [1], "adam": [dim, dim]}[rule.kind]
    return [torch.rand(n_rows, c, generator=g) for c in cols]


def check_update(rows, states, rows0, states0, ref_rows, ref_states, live):
    """Touched rows within tolerance, everything else (NaN rows included) bit-identical."""
    atol, rtol = UPDATE_TOL[rows.dtype]
    assert_close(rows[live], ref_rows[live], atol, rtol, "rows")
    for s, r in zip(states, ref_states):
        assert_close(s[live], r[live], 1e-6, 1e-6, "state")
    dead = torch.ones(rows.shape[0], dtype=torch.bool)
    dead[live] = False
    assert torch.equal(bits(rows[dead]), bits(rows0[dead]))
    for s, s0 in zip(states, states0):
        assert torch.equal(s[dead], s0[dead])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", DIMS, ids=[f"dim{d}" for d in DIMS])
@pytest.mark.parametrize("rule_name", list(RULES))
def test_sparse_update(rule_name, dim, dtype):
    rule = RULES[rule_name]
    b = make_batch(dim, dtype)
    n = int(b["n_uniq"])
    grad_u = kernels.bag_backward_torch(b["grad_out"], b["inverse"], b["offsets"], MODE_SUM)
    grad_u[n:] = float("nan")  # past n_uniq: never read
    states0 = make_states(rule, b["rows"].shape[0], dim)
    rows, states = b["rows"].clone(), [s.clone() for s in states0]
    ref_rows, ref_states = b["rows"].clone(), [s.clone() for s in states0]
    sparse_update_triton(rows, states, b["loc_u"], grad_u, b["n_uniq"], rule)
    kernels.sparse_update_torch(ref_rows, ref_states, b["loc_u"], grad_u, b["n_uniq"], rule)
    check_update(rows, states, b["rows"], states0, ref_rows, ref_states, b["loc_u"][:n])


# ----------------------------------------------------------------- fused backward + update
DIM_DTYPES = [pytest.param(d, torch.float32, id=f"dim{d}-fp32") for d in DIMS] + [
    pytest.param(d, torch.bfloat16, id=f"dim{d}-bf16") for d in (7, 129)]


@pytest.mark.parametrize("dim,dtype", DIM_DTYPES)
@pytest.mark.parametrize("mode_name", list(MODES))
@pytest.mark.parametrize("rule_name", list(RULES))
def test_backward_update(rule_name, mode_name, dim, dtype):
    rule = RULES[rule_name]
    mode, use_psw = MODES[mode_name]
    b = make_batch(dim, dtype)
    n = int(b["n_uniq"])
    _, max_pos = kernels.pooled_forward_torch(b["rows"], b["loc_u"], b["inverse"], b["offsets"], mode)
    states0 = make_states(rule, b["rows"].shape[0], dim)
    rows, states = b["rows"].clone(), [s.clone() for s in states0]
    ref_rows, ref_states = b["rows"].clone(), [s.clone() for s in states0]
    rest = (b["grad_out"], b["inverse"], b["offsets"], mode, b["psw"] if use_psw else None, max_pos, rule)
    backward_update_triton(rows, states, b["loc_u"], b["n_uniq"], *rest)
    kernels.backward_update_torch(ref_rows, ref_states, b["loc_u"], b["n_uniq"], *rest)
    check_update(rows, states, b["rows"], states0, ref_rows, ref_states, b["loc_u"][:n])


@pytest.mark.parametrize("rule_name", list(RULES))
def test_backward_update_tiled_duplicates(rule_name):
    """The GPU tiling (block_l > 1) on a duplicate-heavy batch: 3 ids over 400 lookups."""
    rule = RULES[rule_name]
    b = make_batch(60, n_ids=4, lengths=(300, 0, 60, 40), pad_id=3, seed=3)
    states0 = make_states(rule, b["rows"].shape[0], 60)
    rows, states = b["rows"].clone(), [s.clone() for s in states0]
    ref_rows, ref_states = b["rows"].clone(), [s.clone() for s in states0]
    rest = (b["grad_out"], b["inverse"], b["offsets"], MODE_SUM, b["psw"], None, rule)
    _backward_update_triton(rows, states, b["loc_u"], b["n_uniq"], *rest, block_l=16)
    kernels.backward_update_torch(ref_rows, ref_states, b["loc_u"], b["n_uniq"], *rest)
    live = b["loc_u"][:int(b["n_uniq"])]
    # hundreds of terms summed in tiles: a different fp32 order than the reference's
    assert_close(rows[live], ref_rows[live], 5e-5, 5e-5, "rows")
    for s, r in zip(states, ref_states):
        assert_close(s[live], r[live], 5e-5, 5e-5, "state")


def test_tiled_backward_of_a_hot_id_is_compensated():
    """The GPU tiling (block_l = 16) of one id looked up 6000 times: tiles accumulated with Kahan compensation
    stay within a few ulps of the exact sum, where the sequential fp32 running sum drifts (every product here is
    exact, so what differs is the accumulation alone)."""
    g = torch.Generator().manual_seed(5)
    n_lookups = 6000
    ids = torch.where(torch.rand(n_lookups, generator=g) < 0.95, 1, torch.randint(2, 6, (n_lookups,), generator=g))
    offsets = torch.arange(0, n_lookups + 1, 2)
    _, inverse, _, n_uniq = kernels.unique_ids_torch(ids)
    n = int(n_uniq)
    rule = UpdateRule("sgd", lr=1.0)
    loc_u = torch.full((n_lookups,), -1, dtype=torch.int64)
    loc_u[:n] = torch.arange(n)
    rows0 = torch.zeros(n, 8)
    grad_out = torch.rand(offsets.numel() - 1, 8, generator=g) + 1.0
    rest = (grad_out, inverse, offsets, MODE_SUM, None, None, rule)
    tiled, seq, exact = rows0.clone(), rows0.clone(), rows0.double()
    _backward_update_triton(tiled, [], loc_u, n_uniq, *rest, block_l=16)
    kernels.backward_update_torch(seq, [], loc_u, n_uniq, *rest)
    kernels.backward_update_torch(exact, [], loc_u, n_uniq, grad_out.double(), inverse, offsets, MODE_SUM,
                                  None, None, rule)
    ulp = torch.finfo(torch.float32).eps * exact.abs()
    err_tiled = (tiled.double() - exact).abs()
    err_seq = (seq.double() - exact).abs()
    assert bool((err_tiled <= 2 * ulp).all()), (err_tiled / ulp).max()
    assert float(err_seq[0].max()) > 4 * float(err_tiled[0].max())  # the hot id: the drift being fixed


def test_update_nothing_live():
    """n_uniq = 0 (all padding) and B = 0: no row or state changes."""
    rule = RULES["adam"]
    b = make_batch(7, lengths=(3, 2), n_ids=1, pad_id=0)
    assert int(b["n_uniq"]) == 0
    states0 = make_states(rule, b["rows"].shape[0], 7)
    rows, states = b["rows"].clone(), [s.clone() for s in states0]
    backward_update_triton(rows, states, b["loc_u"], b["n_uniq"], b["grad_out"], b["inverse"], b["offsets"],
                           MODE_MEAN, None, None, rule)
    sparse_update_triton(rows, states, b["loc_u"], torch.full((5, 7), float("nan")), b["n_uniq"], rule)
    empty = torch.zeros(0, dtype=torch.int64)
    sparse_update_triton(rows, states, empty, torch.zeros(0, 7), torch.zeros(1, dtype=torch.int64), rule)
    backward_update_triton(rows, states, empty, torch.zeros(1, dtype=torch.int64), torch.zeros(0, 7), empty,
                           torch.zeros(1, dtype=torch.int64), MODE_SUM, None, None, rule)
    assert torch.equal(bits(rows), bits(b["rows"]))
    assert all(torch.equal(s, s0) for s, s0 in zip(states, states0))


# ----------------------------------------------------------------- GPU only
def zipf_batch(n_lookups, n_bags, n_ids, dim, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, n_ids + 1, dtype=torch.float64)
    ids = torch.multinomial(ranks.pow(-1.2), n_lookups, replacement=True, generator=g).to(device)
    lengths = torch.multinomial(torch.ones(n_bags), n_lookups, replacement=True, generator=g).bincount(
        minlength=n_bags)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    uniq, inverse, counts, n_uniq = kernels.unique_ids_torch(ids, padding_idx=7)
    n = int(n_uniq)
    n_rows = n + 1000
    loc_u = torch.full((n_lookups,), -1, dtype=torch.int64, device=device)
    loc_u[:n] = torch.randperm(n_rows, generator=g)[:n].to(device)
    rows = torch.randn(n_rows, dim, generator=g).to(device=device, dtype=dtype)
    return rows, loc_u, inverse, offsets, n_uniq


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode_name", list(MODES))
@pytest.mark.parametrize("rule_name", list(RULES))
def test_cuda_backward_update_duplicate_stress(rule_name, mode_name):
    """Zipf-1.2 ids: the hottest id has ~46k of the 200k lookups. fp32 sums that long differ by order (the
    reference reduces in its own order), so both are judged against a float64 reference: the kernel's error
    must stay within a few times the fp32 reference's own error, element by element (plus fp32 rounding of
    the values themselves)."""
    rule = RULES[rule_name]
    mode, use_psw = MODES[mode_name]
    rows0, loc_u, inverse, offsets, n_uniq = zipf_batch(200_000, 4096, 5000, 128, "cuda", torch.float32)
    g = torch.Generator(device="cuda").manual_seed(1)
    psw = torch.rand(inverse.numel(), device="cuda", generator=g) if use_psw else None
    grad_out = torch.randn(offsets.numel() - 1, 128, device="cuda", generator=g)
    _, max_pos = kernels.pooled_forward_torch(rows0, loc_u, inverse, offsets, mode)
    states0 = [s.cuda() for s in make_states(rule, rows0.shape[0], 128)]
    rows, states = rows0.clone(), [s.clone() for s in states0]
    ref_rows, ref_states = rows0.clone(), [s.clone() for s in states0]
    exact_rows, exact_states = rows0.double(), [s.double() for s in states0]
    rest = (grad_out, inverse, offsets, mode, psw, max_pos, rule)
    backward_update_triton(rows, states, loc_u, n_uniq, *rest)
    # A moving result is a race: the same inputs must give the same bits.
    again_rows, again_states = rows0.clone(), [s.clone() for s in states0]
    backward_update_triton(again_rows, again_states, loc_u, n_uniq, *rest)
    assert torch.equal(again_rows, rows) and all(torch.equal(a, b) for a, b in zip(again_states, states))
    kernels.backward_update_torch(ref_rows, ref_states, loc_u, n_uniq, *rest)
    rest64 = (grad_out.double(), inverse, offsets, mode, psw.double() if psw is not None else None, max_pos, rule)
    kernels.backward_update_torch(exact_rows, exact_states, loc_u, n_uniq, *rest64)
    torch.cuda.synchronize()
    live = loc_u[:int(n_uniq)]

    def within_reference_error(ours, ref, exact, what):
        err, ref_err = (ours[live].double() - exact[live]).abs(), (ref[live].double() - exact[live]).abs()
        scale = exact[live].norm()
        rel, ref_rel = float(err.norm() / scale), float(ref_err.norm() / scale)
        assert rel <= max(2 * ref_rel, 1e-6), f"{what}: relative error {rel:.3g} vs the fp32 reference's {ref_rel:.3g}"
        bound = 4 * ref_err + 1e-5 * exact[live].abs() + 1e-6  # element-wise: rounding-level, never a wrong row
        bad = err > bound
        assert not bool(bad.any()), (f"{what}: {int(bad.sum())} elements off by more than 4x the fp32 "
                                     f"reference's error; worst {float((err - bound).max()):.3g}")

    within_reference_error(rows, ref_rows, exact_rows, "rows")
    for s, r, e in zip(states, ref_states, exact_states):
        within_reference_error(s, r, e, "state")
    dead = torch.ones(rows.shape[0], dtype=torch.bool, device="cuda")
    dead[live] = False
    assert torch.equal(rows[dead], rows0[dead])
    grad_u = bag_backward_triton(grad_out, inverse, offsets, mode, psw, max_pos)
    grad_ref = kernels.bag_backward_torch(*rest[:-1])
    grad_exact = kernels.bag_backward_torch(*rest64[:-1])
    n = int(n_uniq)
    err, ref_err = (grad_u[:n].double() - grad_exact[:n]).abs(), (grad_ref[:n].double() - grad_exact[:n]).abs()
    assert bool((err <= 4 * ref_err + 1e-5 * grad_exact[:n].abs() + 1e-5).all()), "grad_u"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode_name", list(MODES))
def test_cuda_forward_bf16_vs_fp32(mode_name):
    mode, use_psw = MODES[mode_name]
    rows, loc_u, inverse, offsets, _ = zipf_batch(100_000, 4096, 50_000, 128, "cuda", torch.bfloat16)
    psw = torch.rand(inverse.numel(), device="cuda") if use_psw else None
    out, max_pos = pooled_forward_triton(rows, loc_u, inverse, offsets, mode, psw)
    ref, ref_pos = kernels.pooled_forward_torch(rows.float(), loc_u, inverse, offsets, mode, psw)
    # one bf16 rounding of an fp32-accumulated result
    assert_close(out, ref, 1e-2, 8e-3, "bf16 forward")
    if mode == MODE_MAX:
        assert torch.equal(max_pos, ref_pos)
    out32, _ = pooled_forward_triton(rows.float(), loc_u, inverse, offsets, mode, psw)
    assert_close(out32, ref, 1e-5, 1e-5, "fp32 forward")
