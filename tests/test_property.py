"""Property-based tests (hypothesis): CachedEmbeddingBag against nn.EmbeddingBag on random tables (rows, dim,
mode, float32/float64), input forms (1-D + offsets with empty bags, duplicate ids and include_last_offset, 2-D),
padding_idx, per_sample_weights and cache sizes from one row, on both kernel backends (Triton under the
interpreter) and both sizing rules. A valid input gives nn's output and gradients, and a training step (fused or
through a torch optimizer) gives nn's table; an input nn rejects is rejected with an exception of nn's type and
leaves every byte of the module's state as it was.

CI runs a few derandomized examples per case (fixed inputs, no example database); `pytest --slow` runs many random
ones. A failure prints the falsifying example.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import cachedemb
from conftest import skip_triton_on_cpu_without_interpreter

pytestmark = [pytest.mark.usefixtures("sizing_mode")]

_BASE = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
             print_blob=True)
# Examples per test: (CI, --slow). The Triton interpreter costs ~1-3 s per training step, the reference ~0.1 s.
_EXAMPLES = {"torch": (14, 400), "triton": (2, 40)}


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    skip_triton_on_cpu_without_interpreter(request.param)
    monkeypatch.setenv("CACHEDEMB_BACKEND", request.param)
    return request.param


def run_property(request, backend: str, strategy, prop) -> None:
    """Run `prop` over `strategy` with the CI settings (few derandomized examples) or, under --slow, many."""
    ci, slow = _EXAMPLES[backend]
    if request.config.getoption("--slow"):
        chosen = settings(max_examples=slow, **_BASE)
    else:
        chosen = settings(max_examples=ci, derandomize=True, database=None, **_BASE)
    given(strategy)(chosen(prop))()


# ----------------------------------------------------------------- strategies
@st.composite
def tables(draw):
    """A table configuration: constructor keywords shared by nn.EmbeddingBag and ours, plus our cache size."""
    num = draw(st.integers(1, 14))
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    return dict(num=num, dim=draw(st.integers(1, 5)), mode=mode,
                dtype=draw(st.sampled_from([torch.float32, torch.float64])),
                include_last_offset=draw(st.booleans()),
                padding_idx=draw(st.one_of(st.none(), st.integers(-num, num - 1))),
                cache_rows=draw(st.integers(1, num)),
                training=draw(st.sampled_from(["fused_sgd", "torch_sgd_sparse", "torch_sgd_dense", "no_grad"]
                                              if mode != "max" else ["fused_sgd", "torch_sgd_dense", "no_grad"])),
                seed=draw(st.integers(0, 2**16)))


@st.composite
def batches(draw, cfg):
    """A valid input for `cfg`: (input, offsets, per_sample_weights). Ids often come from a small pool
    (duplicate-heavy); offsets are any non-decreasing run from 0 (empty bags, offsets[-1] < len(input))."""
    num = cfg["num"]
    pool = draw(st.one_of(st.just(list(range(num))),
                          st.lists(st.integers(0, num - 1), min_size=1, max_size=3)))
    id_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    if draw(st.booleans()):  # 1-D input + offsets
        ids = draw(st.lists(st.sampled_from(pool), max_size=12))
        n = len(ids)
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
        offsets = [0] + cuts
        if cfg["include_last_offset"] and draw(st.booleans()):
            offsets.append(n)  # the usual form: the last offset is the input's end
        if not cfg["include_last_offset"] and draw(st.integers(0, 9)) == 0:
            offsets = []  # no bags at all
        inp = torch.tensor(ids, dtype=id_dtype)
        off = torch.tensor(offsets, dtype=id_dtype)
    else:  # 2-D: bags x ids per bag
        bags, width = draw(st.integers(0, 4)), draw(st.integers(1, 4))
        ids = draw(st.lists(st.sampled_from(pool), min_size=bags * width, max_size=bags * width))
        inp, off = torch.tensor(ids, dtype=id_dtype).reshape(bags, width), None
    psw = None
    if cfg["mode"] == "sum" and draw(st.booleans()):
        values = draw(st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=inp.numel(),
                               max_size=inp.numel()))
        psw = torch.tensor(values, dtype=cfg["dtype"]).reshape(inp.shape)
    return inp, off, psw


# ----------------------------------------------------------------- helpers
def make_pair(cfg):
    """nn.EmbeddingBag and ours on the same random table."""
    torch.manual_seed(cfg["seed"])
    fused = cfg["training"] == "fused_sgd"
    kw = dict(mode=cfg["mode"], include_last_offset=cfg["include_last_offset"], padding_idx=cfg["padding_idx"],
              dtype=cfg["dtype"], sparse=cfg["training"] == "torch_sgd_sparse")
    ref = nn.EmbeddingBag(cfg["num"], cfg["dim"], **kw)
    ours = cachedemb.CachedEmbeddingBag(cfg["num"], cfg["dim"], cache_rows=cfg["cache_rows"], device="cpu",
                                        _weight=ref.weight.detach().clone(),
                                        optimizer=cachedemb.optim.SGD(lr=0.5) if fused else None, **kw)
    return ref, ours


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-11)


def table_of(m) -> torch.Tensor:
    return m.weight.detach().clone()


def nn_overruns(cfg, inp, off) -> bool:
    """nn.EmbeddingBag (torch 2.13, CPU) may write out of bounds (segfault) when a non-empty 1-D input has no bags:
    offsets empty, or include_last_offset=True with a single offset (seen with mode="mean", mode="max" or a
    padding_idx). The result is empty either way; such a batch is asked of nn without its lookups."""
    if inp.dim() != 1 or off is None or off.dim() != 1 or inp.numel() == 0:
        return False
    return off.numel() == int(cfg["include_last_offset"])


def nn_form(cfg, inp, off, psw):
    """The batch as nn is asked it: a 2-D input with include_last_offset=True as the same bags in 1-D form (B + 1
    offsets, N lookups each). torch 2.13's F.embedding_bag drops include_last_offset for 2-D input itself; torch
    2.5's passes it on with B offsets, and its CPU kernel then segfaults (max mode, or a padding_idx)."""
    if not (cfg["include_last_offset"] and torch.is_tensor(inp) and inp.dim() == 2 and off is None
            and not inp.is_floating_point() and inp.shape[1] > 0):
        return inp, off, psw
    if psw is not None and (not torch.is_tensor(psw) or psw.shape != inp.shape):
        return inp, off, psw
    b, n = inp.shape
    return inp.reshape(-1), torch.arange(b + 1, dtype=inp.dtype) * n, None if psw is None else psw.reshape(-1)


def nn_gradient_view(cfg, inp, off):
    """(lookups kept, factor on the last bag's upstream gradient) under which nn's backward gives the true
    gradient of nn's forward. With include_last_offset and lookups past offsets[-1] (sum/mean without
    padding_idx), nn's forward ignores those lookups but its backward gives them the last bag's gradient (mean)
    or reads uninitialized memory (sum, seen as 4.6e-41 entries): nn is asked without them, and the last bag of
    a mean, which nn divides by its lookups up to the input's end, gets its upstream gradient scaled to match."""
    if nn_overruns(cfg, inp, off):
        return 0, None
    if inp.dim() != 1 or not cfg["include_last_offset"] or off.numel() < 2:
        return inp.numel(), None
    n, end, start = inp.numel(), int(off[-1]), int(off[-2])
    if end >= n or cfg["padding_idx"] is not None or cfg["mode"] == "max":
        return n, None  # no lookups past the end, or nn's last bag runs to the end (forward and backward)
    return end, (end - start) / (n - start) if cfg["mode"] == "mean" else None


def train_step(ref, ours, cfg, batch):
    """One batch on both modules; asserts equal outputs, gradients and tables after the step."""
    inp, off, psw = batch
    n_inp, n_off, n_psw = nn_form(cfg, inp, off, psw)
    t = tol(cfg["dtype"])
    keep, last_factor = nn_gradient_view(cfg, n_inp, n_off)
    with torch.no_grad():
        if keep == inp.numel() or (cfg["dtype"] == torch.float32 and keep > 0):
            expected = ref(n_inp, n_off, n_psw)
        else:
            # No bags (nn may overrun), or float64 with lookups past offsets[-1]: nn's float64 CPU kernel pools
            # them into the last bag while its float32/16/bf16 kernels (and ours, at every dtype) stop the sum at
            # offsets[-1] and divide a mean by the lookups up to the end; the float32 rule, computed in float64.
            expected = ref(n_inp[:keep], n_off, None if n_psw is None else n_psw.reshape(-1)[:keep])
            if last_factor is not None and expected.shape[0] > 0:
                expected[-1] *= last_factor
    if cfg["training"] == "no_grad":
        with torch.no_grad():
            got = ours(inp, off, psw)
        torch.testing.assert_close(got, expected, **t)
        return
    psw_ours = psw.clone().requires_grad_() if psw is not None else None
    got = ours(inp, off, psw_ours)
    torch.testing.assert_close(got, expected, **t)
    # A fixed, non-uniform upstream gradient so every bag and column matters.
    g = torch.linspace(-1, 1, max(expected.numel(), 1), dtype=expected.dtype)[: expected.numel()]
    g = g.reshape(expected.shape)
    (got * g).sum().backward()
    # nn's gradient, on the lookups it pools (see nn_gradient_view).
    flat_psw = n_psw.reshape(-1)[:keep].clone().requires_grad_() if n_psw is not None else None
    if keep == inp.numel():
        ref_inp, ref_psw = n_inp, flat_psw.reshape(n_psw.shape) if n_psw is not None else None
    else:
        ref_inp, ref_psw = n_inp[:keep], flat_psw
    g_ref = g.clone()
    if last_factor is not None and g_ref.shape[0] > 0:
        g_ref[-1] *= last_factor
    (ref(ref_inp, n_off, ref_psw) * g_ref).sum().backward()
    if psw is not None:
        expected_psw_grad = torch.zeros(psw.numel(), dtype=psw.dtype)
        if flat_psw.grad is not None:
            expected_psw_grad[:keep] = flat_psw.grad
        torch.testing.assert_close(psw_ours.grad, expected_psw_grad.reshape(psw.shape), **t)
    lr = 0.5
    with torch.no_grad():
        ref_grad = ref.weight.grad
        if ref_grad is not None:
            ref.weight -= lr * (ref_grad.to_dense() if ref_grad.is_sparse else ref_grad)
    if cfg["training"] != "fused_sgd":
        our_grad = ours.weight.grad
        if ref_grad is None:
            assert our_grad is None
        else:
            assert our_grad.is_sparse == ref_grad.is_sparse
            torch.testing.assert_close(our_grad.to_dense(), ref_grad.to_dense(), **t)
            with torch.no_grad():
                ours.weight -= lr * our_grad.to_dense()
        ours.weight.grad = None
    ref.weight.grad = None
    torch.testing.assert_close(table_of(ours), table_of(ref), **t)


def state_bytes(m) -> dict:
    """Every byte of the module's state: host table, optimizer state, counts, cache rows and metadata, index,
    stats, and the host-side counters and flags."""
    out = {}

    def add(name, v):
        if torch.is_tensor(v):
            flat = v.detach().contiguous().reshape(-1)
            out[name] = (v.dtype, tuple(v.shape), flat.view(torch.uint8).clone())
        elif isinstance(v, dict):
            for k, x in v.items():
                add(f"{name}.{k}", x)
        elif isinstance(v, (int, float, bool, str, type(None))):
            out[name] = v

    for k, v in vars(m.cache).items():
        add("cache." + k, v)
    for k in ("optimizer_step", "_handed_out", "_seen_version", "training"):
        add(k, getattr(m, k))
    add("table_version", m._table._version)
    return out


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for k in before:
        a, b = before[k], after[k]
        if isinstance(a, tuple):
            assert a[:2] == b[:2] and torch.equal(a[2], b[2]), f"state {k} changed"
        else:
            assert a == b, f"state {k} changed: {a!r} -> {b!r}"


# ----------------------------------------------------------------- valid inputs
@st.composite
def training_runs(draw):
    cfg = draw(tables())
    return cfg, draw(st.lists(batches(cfg), min_size=1, max_size=2))


def test_forward_gradients_and_training_equal_nn(request, backend):
    def prop(run):
        cfg, batch_list = run
        ref, ours = make_pair(cfg)
        for batch in batch_list:
            train_step(ref, ours, cfg, batch)

    run_property(request, backend, training_runs(), prop)


# ----------------------------------------------------------------- invalid inputs
# Mutations of a valid input that nn.EmbeddingBag rejects. "Undefined" ones (decreasing or negative offsets) are
# not given to nn (its CPU kernel may read out of bounds); ours must refuse them with nn's type for bad offsets.
MUTATIONS = ["id_negative", "id_too_large", "offsets_first_not_zero", "offsets_past_end", "offsets_decreasing",
             "offsets_negative", "float_ids", "float_offsets", "offsets_2d", "offsets_missing", "offsets_with_2d",
             "input_3d", "psw_wrong_shape", "psw_wrong_dtype", "psw_not_sum", "ilo_no_offsets", "ids_not_tensor"]
UNDEFINED_IN_NN = {"offsets_decreasing": RuntimeError, "offsets_negative": RuntimeError}


def mutate(kind, cfg, inp, off, psw):
    """(input, offsets, per_sample_weights) with one defect; None where the defect does not apply to `cfg`."""
    num = cfg["num"]
    flat = inp.reshape(-1)
    if kind in ("id_negative", "id_too_large"):
        if flat.numel() == 0:
            return None
        bad = flat.clone()
        bad[len(bad) // 2] = -1 if kind == "id_negative" else num + len(bad)
        return bad.reshape(inp.shape), off, psw
    if kind in ("float_ids",):
        return inp.to(torch.float32), off, psw
    if kind == "input_3d":
        return inp.reshape(1, 1, -1), None, None
    if kind == "ids_not_tensor":
        return flat.tolist(), off, psw
    if kind == "offsets_with_2d":
        return (inp, torch.zeros(1, dtype=torch.int64), psw) if inp.dim() == 2 else None
    if kind == "psw_not_sum":
        return (inp, off, torch.ones(inp.shape, dtype=cfg["dtype"])) if cfg["mode"] != "sum" else None
    if kind == "psw_wrong_shape":
        return (inp, off, torch.ones(inp.numel() + 1, dtype=cfg["dtype"])) if cfg["mode"] == "sum" else None
    if kind == "psw_wrong_dtype":
        other = torch.float64 if cfg["dtype"] == torch.float32 else torch.float32
        return (inp, off, torch.ones(inp.shape, dtype=other)) if cfg["mode"] == "sum" else None
    if inp.dim() != 1:
        return None  # the rest are offsets defects
    n = inp.numel()
    if kind == "offsets_missing":
        return inp, None, psw
    if kind == "offsets_2d":
        return inp, off.reshape(1, -1), psw
    if kind == "float_offsets":
        return inp, off.to(torch.float32), psw
    if kind == "ilo_no_offsets":
        return (inp, off[:0], psw) if cfg["include_last_offset"] else None
    if off.numel() == 0:
        return None
    bad = off.clone()
    if kind == "offsets_first_not_zero":
        bad[0] = 1 + n % 3
    elif kind == "offsets_past_end":
        bad[-1] = n + 1
    elif kind == "offsets_negative":
        bad[-1] = -1
    elif kind == "offsets_decreasing":
        if off.numel() < 2 or n == 0:
            return None
        bad[-2], bad[-1] = n, n - 1
    return inp, bad, psw


@st.composite
def rejected_inputs(draw):
    cfg = draw(tables())
    warm = draw(batches(cfg))
    kind = draw(st.sampled_from(MUTATIONS))
    bad = mutate(kind, cfg, *draw(batches(cfg)))
    if bad is None:  # the defect does not apply to this input: float ids always do
        kind = "float_ids"
        bad = mutate(kind, cfg, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), None)
    return cfg, warm, kind, bad


def test_rejected_input_leaves_state_unchanged(request, backend):
    def prop(case):
        cfg, warm, kind, bad = case
        ref, ours = make_pair(cfg)
        if cfg["training"] != "no_grad":
            train_step(ref, ours, cfg, warm)  # a used cache: resident rows, counts, dirty rows, stats
        if kind in UNDEFINED_IN_NN:
            expected = UNDEFINED_IN_NN[kind]
        elif all(torch.is_tensor(t) and not t.is_floating_point() for t in bad[:2]) and \
                nn_overruns(cfg, bad[0], bad[1]) and (bad[2] is None or (
                    bad[2].shape == bad[0].shape and bad[2].dtype == cfg["dtype"] and cfg["mode"] == "sum")):
            # No bags: nn's CPU kernel is undefined here (sometimes raises on an id it never pools, sometimes
            # not); no lookup is pooled, so ours accepts it with an empty result.
            train_step(ref, ours, cfg, bad)
            return
        else:
            try:
                with torch.no_grad():
                    ref(*nn_form(cfg, *bad))
            except Exception as error:  # noqa: BLE001 - any type nn raises is the one ours must raise
                expected = type(error)
            else:
                # nn accepts it (e.g. a bad id past offsets[-1] with include_last_offset: never looked up), so
                # ours must too, with nn's result.
                train_step(ref, ours, cfg, bad)
                return
        before = state_bytes(ours)
        with pytest.raises(expected):
            ours(*bad)
        with torch.no_grad(), pytest.raises(expected):
            ours(*bad)
        assert_same_state(before, state_bytes(ours))
        # Still a working module, equal to nn.
        train_step(ref, ours, cfg, warm)

    run_property(request, backend, rejected_inputs(), prop)


# ----------------------------------------------------------------- inputs the properties found
REGRESSIONS = [
    # 1-D input with empty offsets (no bags): backward raised IndexError in bag_of_lookup.
    (dict(num=1, dim=1, mode="mean", include_last_offset=False), (torch.tensor([0]), torch.tensor([], dtype=torch.int64), None)),
    # Every lookup padding (2-D, mean, fused): the reference backward called embedding_bag with lookups but no
    # offsets, which writes out of bounds (segfault, now and then).
    (dict(num=1, dim=1, mode="mean", include_last_offset=True, padding_idx=0),
     (torch.zeros(3, 3, dtype=torch.int64), None, None)),
    # include_last_offset, mean, a lookup past offsets[-1], float64 (nn's float64 kernel pools it, see train_step).
    (dict(num=2, dim=1, mode="mean", include_last_offset=True, dtype=torch.float64),
     (torch.tensor([0, 0]), torch.tensor([0, 1]), None)),
]


def test_found_rejections():
    """Exception types the properties found differing from nn.EmbeddingBag's."""
    cfg = dict(num=3, dim=2, mode="sum", dtype=torch.float32, include_last_offset=True, padding_idx=None,
               cache_rows=1, training="fused_sgd", seed=0)
    _, ours = make_pair(cfg)
    with pytest.raises(RuntimeError, match="at least one offset"):  # was a bare ValueError
        ours(torch.tensor([0]), torch.tensor([], dtype=torch.int64))
    with pytest.raises(AttributeError, match="torch.Tensor"):  # nn: AttributeError ('list' has no .dim()); was TypeError
        ours([0, 1], torch.tensor([0, 1]))


@pytest.mark.parametrize("case", range(len(REGRESSIONS)))
def test_found_inputs(monkeypatch, case):
    monkeypatch.setenv("CACHEDEMB_BACKEND", "torch")  # the reference kernels crashed; Triton is slow here
    overrides, batch = REGRESSIONS[case]
    for training in ("fused_sgd", "torch_sgd_dense"):
        cfg = dict(dtype=torch.float32, padding_idx=None, cache_rows=1, training=training, seed=0)
        cfg.update(overrides)
        ref, ours = make_pair(cfg)
        for _ in range(3):
            train_step(ref, ours, cfg, batch)
