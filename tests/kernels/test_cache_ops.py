"""Triton cache ops (unique_ids, slot_lookup, victim_select, row_copy) against their pure-torch references.

Under the interpreter (conftest sets TRITON_INTERPRET=1) every case runs on CPU tensors; with
`TRITON_INTERPRET=0` on a CUDA machine the same cases run on the GPU, plus the large GPU-only cases at the end.
All ops are integer work or copies, so every comparison is exact.
"""
import os

import pytest
import torch

from cachedemb.kernels.row_copy import row_copy_mode, row_copy_staged, row_copy_torch, row_copy_triton
from cachedemb.kernels.slot_lookup import EMPTY_KEY, slot_lookup_torch, slot_lookup_triton
from cachedemb.kernels.unique_ids import unique_ids_torch, unique_ids_triton
from cachedemb.kernels.victim_select import PROTECTED, victim_select_torch, victim_select_triton

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
if not INTERPRETED and not HAS_CUDA:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_gpu = pytest.mark.skipif(INTERPRETED or not HAS_CUDA, reason="needs CUDA with TRITON_INTERPRET=0")


def assert_same(out, ref, what=""):
    """Same shape, dtype, device and values; NaN equals NaN (poisoned rows that must stay untouched)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    assert out.device == ref.device, f"{what}: device {out.device} != {ref.device}"
    same = (out == ref) | (out.isnan() & ref.isnan()) if out.is_floating_point() else out == ref
    if not bool(same.all()):
        bad = (~same).nonzero()[:5].tolist()
        pytest.fail(f"{what}: {int((~same).sum())} of {out.numel()} differ, first at {bad}: "
                    f"got {[out[tuple(i)].item() for i in bad]}, want {[ref[tuple(i)].item() for i in bad]}")


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- unique_ids

UNIQUE_CASES = {
    # name: (batch size, id range, padding_idx)
    "single": (1, 5, None),
    "odd_dups_heavy": (1001, 17, None),
    "mostly_unique": (777, 10**6, None),
    "big_ids": (333, 2**40, None),
    "pad_present": (517, 23, 0),
    "pad_absent": (517, 23, 10**9),
    "pad_in_middle": (999, 40, 20),
    "all_same": (64, 1, None),
    "only_padding": (50, 1, 0),
    "empty": (0, 10, None),
    "empty_with_pad": (0, 10, 3),
    "multi_block": (9001, 3000, 7),
}


@pytest.mark.parametrize("name", list(UNIQUE_CASES))
def test_unique_ids(name):
    B, hi, pad = UNIQUE_CASES[name]
    ids = torch.randint(0, hi, (B,), generator=gen(B)).to(DEVICE)
    got = unique_ids_triton(ids, pad, return_groups=True)
    ref = unique_ids_torch(ids, pad, return_groups=True)
    for what, g, r in zip(("uniq", "inverse", "counts", "n_uniq"), got, ref):
        assert_same(g, r, what)
    assert_same(got[4][0], ref[4][0], "perm")
    assert_same(got[4][1], ref[4][1], "ptr")


def test_unique_ids_int32_2d_input():
    ids = torch.randint(0, 9, (7, 13), generator=gen(1), dtype=torch.int32).to(DEVICE)
    for what, g, r in zip(("uniq", "inverse", "counts", "n_uniq"), unique_ids_triton(ids, 4), unique_ids_torch(ids, 4)):
        assert_same(g, r, what)


# ---------------------------------------------------------------- slot_lookup

SLOT_CASES = {
    # name: (capacity, resident ids, batch, n_query)
    "full_cache": (64, 64, 200, 200),
    "half_empty": (101, 50, 333, 333),
    "capacity_1_hit": (1, 1, 9, 9),
    "capacity_1_empty": (1, 0, 9, 9),
    "capacity_2": (2, 2, 17, 17),
    "n_lt_batch": (37, 30, 129, 61),
    "n_zero": (37, 30, 40, 0),
    "empty_batch": (16, 8, 0, 0),
    "multi_block": (3000, 2500, 9001, 8500),
}


def make_index(capacity, resident, seed):
    ids = torch.randperm(4 * capacity + 8, generator=gen(seed))[:resident]
    keys = torch.full((capacity,), EMPTY_KEY, dtype=torch.int64)
    keys[:resident] = ids
    slot_of = torch.randperm(capacity, generator=gen(seed + 1))
    keys, order = torch.sort(keys)
    return keys, slot_of[order], ids


@pytest.mark.parametrize("name", list(SLOT_CASES))
def test_slot_lookup(name):
    capacity, resident, B, n = SLOT_CASES[name]
    keys, slots, ids = make_index(capacity, resident, seed=capacity)
    query = torch.randint(-3, 4 * capacity + 8, (B,), generator=gen(B))
    if B > 2 and resident:
        query[1::3] = ids[torch.randint(0, resident, (len(query[1::3]),), generator=gen(7))]  # plenty of hits
    keys, slots, query = keys.to(DEVICE), slots.to(DEVICE), query.to(DEVICE)
    n_query = torch.tensor([n], device=DEVICE)
    ref = slot_lookup_torch(keys, slots, query, n_query)
    assert_same(slot_lookup_triton(keys, slots, query, n_query), ref, "slots")
    if resident and n and B > 2:
        assert bool((ref >= 0).any()), "case has no hits: it tests nothing"


def test_slot_lookup_zero_capacity():
    keys = torch.empty(0, dtype=torch.int64, device=DEVICE)
    query = torch.arange(5, device=DEVICE)
    out = slot_lookup_triton(keys, keys, query, torch.tensor([5], device=DEVICE))
    assert_same(out, torch.full_like(query, -1), "slots")


# ---------------------------------------------------------------- victim_select


def scores(kind, C, seed):
    g = gen(seed)
    if kind == "positive":
        return torch.randperm(10 * C, generator=g)[:C]
    if kind == "negative":
        return torch.randperm(10 * C, generator=g)[:C] - 7 * C
    if kind == "wide":  # the whole int64 range, both signs
        s = torch.randint(-(2**63) + 1, 2**63 - 2, (2 * C,), generator=g).unique()
        return s[torch.randperm(s.numel(), generator=g)[:C]]
    if kind == "clustered":  # identical high bytes: the threshold is decided in the last passes
        return (1 << 40) + torch.randperm(3 * C, generator=g)[:C]
    if kind == "policy_like":  # empty slots negative, occupied key * C + slot, a third protected
        key = torch.randint(0, 50, (C,), generator=g)
        s = key * C + torch.arange(C)
        s[torch.randperm(C, generator=g)[: C // 5]] = torch.arange(C // 5) - C
        s[torch.randperm(C, generator=g)[: C // 3]] = PROTECTED
        return s
    raise ValueError(kind)


VICTIM_CASES = {
    # name: (score kind, C, k)
    "k1": ("positive", 1000, 1),
    "k_eq_C": ("positive", 333, 333),
    "k_gt_C": ("negative", 50, 80),
    "C1": ("positive", 1, 1),
    "negative_odd": ("negative", 1001, 123),
    "wide_int64": ("wide", 4097, 700),
    "clustered": ("clustered", 2049, 1000),
    "policy_protected": ("policy_like", 1500, 900),
    "multi_block": ("positive", 20000, 311),
}


@pytest.mark.parametrize("name", list(VICTIM_CASES))
def test_victim_select(name):
    kind, C, k = VICTIM_CASES[name]
    score = scores(kind, C, seed=C).to(DEVICE)
    unprotected = int((score != PROTECTED).sum())
    k = min(k, unprotected) if kind == "policy_like" else k
    assert_same(victim_select_triton(score, k), victim_select_torch(score, k), "victims")


def test_victim_select_k_zero():
    score = torch.arange(10, device=DEVICE)
    assert_same(victim_select_triton(score, 0), victim_select_torch(score, 0), "victims")


def test_victim_select_into_protected_takes_lowest_slots():
    # k beyond the unprotected slots (the cache may ask for more; it uses only the unprotected ones):
    # the unprotected come first in score order, then protected slots by ascending slot.
    score = torch.tensor([PROTECTED, 5, PROTECTED, -3, PROTECTED, 9, PROTECTED], device=DEVICE)
    out = victim_select_triton(score, 5)
    assert out.tolist() == [3, 1, 5, 0, 2]


# ---------------------------------------------------------------- row_copy

ROW_CASES = {
    # name: (src rows, cols or None for 1-D, capacity, n (int) or ("t", n) for a [1] tensor, src dtype, dst dtype)
    "1d_int64_counts": (40, None, 25, ("t", 20), torch.int64, torch.int64),
    "d1": (30, 1, 11, 11, torch.float32, torch.float32),
    "odd_d37_tensor_n": (300, 37, 129, ("t", 100), torch.float32, torch.float32),
    "d130_wide": (200, 130, 70, ("t", 70), torch.float32, torch.float32),
    "f32_to_bf16": (100, 16, 50, 45, torch.float32, torch.bfloat16),
    "bf16_to_f32": (100, 16, 50, ("t", 50), torch.bfloat16, torch.float32),
    "f16_to_f32": (64, 9, 31, 31, torch.float16, torch.float32),
    "n_gt_capacity": (60, 8, 20, ("t", 1000), torch.float32, torch.float32),
    "n_zero": (60, 8, 20, ("t", 0), torch.float32, torch.float32),
    "empty_idx": (60, 8, 0, 0, torch.float32, torch.float32),
    "many_rows": (5000, 4, 3000, ("t", 2999), torch.float32, torch.float32),
    "2d_grid": (90, 1500, 40, ("t", 37), torch.float32, torch.float32),
}


def make_copy_case(name):
    R, D, cap, n, sdt, ddt = ROW_CASES[name]
    g = gen(R + cap)
    shape = (R,) if D is None else (R, D)
    # bf16-representable values: the cast is then exact whatever the rounding mode (the interpreter truncates
    # fp32 -> bf16 where the GPU rounds to nearest even).
    src = (torch.randn(shape, generator=g) * 100).to(torch.bfloat16).to(sdt)
    if sdt == torch.int64:
        src = torch.randint(-(2**40), 2**40, shape, generator=g)
    dst_rows = R + 7
    dst_shape = (dst_rows,) if D is None else (dst_rows, D)
    dst = torch.full(dst_shape, float("nan")).to(ddt) if ddt.is_floating_point else torch.full(dst_shape, -777)
    src_idx = torch.randint(-1, R, (cap,), generator=g)  # -1: skipped rows
    dst_idx = torch.randperm(dst_rows, generator=g)[:cap]  # distinct destinations
    dst_idx[::5] = -1
    n = torch.tensor([n[1]], device=DEVICE) if isinstance(n, tuple) else n
    return src.to(DEVICE), src_idx.to(DEVICE), dst.to(DEVICE), dst_idx.to(DEVICE), n


@pytest.mark.parametrize("impl", ["triton", "staged"])
@pytest.mark.parametrize("name", list(ROW_CASES))
def test_row_copy(name, impl):
    src, src_idx, dst, dst_idx, n = make_copy_case(name)
    ref = dst.clone()
    row_copy_torch(src, src_idx, ref, dst_idx, n)
    (row_copy_triton if impl == "triton" else row_copy_staged)(src, src_idx, dst, dst_idx, n)
    assert_same(dst, ref, "dst")
    m = min(int(n), src_idx.numel())
    copied = ((src_idx[:m] >= 0) & (dst_idx[:m] >= 0)).sum()
    if dst.is_floating_point():  # rows nobody copied stay NaN
        rows = dst if dst.dim() == 2 else dst.unsqueeze(1)
        assert int((~rows.isnan()).all(1).sum()) == int(copied)


def test_row_copy_mode_env(monkeypatch):
    monkeypatch.setenv("CACHEDEMB_ROW_COPY", "staged")
    assert row_copy_mode() == "staged"
    monkeypatch.setenv("CACHEDEMB_ROW_COPY", "dma")
    with pytest.raises(ValueError, match="zero_copy"):
        row_copy_mode()


def test_row_copy_column_mismatch():
    with pytest.raises(ValueError, match="columns"):
        row_copy_triton(torch.zeros(4, 3), torch.arange(2), torch.zeros(4, 2), torch.arange(2), 2)


# ---------------------------------------------------------------- the cache on the Triton ops


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("sync_free", [False, True], ids=["exact", "sync_free"])
def test_cache_prepare_same_on_both_backends(policy, sync_free, monkeypatch):
    """EmbeddingCache.prepare over a few batches: the Triton ops must leave the cache exactly as the references (the
    id index answering every lookup the same: its layout follows the order the inserts ran in)."""
    from cachedemb.cache.embedding_cache import EmbeddingCache

    monkeypatch.setenv("CACHEDEMB_SYNC_FREE", "1" if sync_free else "0")
    g = gen(3)
    table = torch.randn(120, 5, generator=g)
    batches = [torch.randint(0, 120, (int(b),), generator=g) for b in (40, 7, 63, 1, 90, 25)]
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("CACHEDEMB_BACKEND", backend)
        cache = EmbeddingCache(table.clone(), 32, DEVICE, {"sum_sq": (1, 0.5)}, policy=policy)
        plans = [cache.prepare(ids.to(DEVICE), padding_idx=3) for ids in batches]
        results[backend] = (plans, cache)
    (plans_t, cache_t), (plans_k, cache_k) = results["torch"], results["triton"]
    for i, (pt, pk) in enumerate(zip(plans_t, plans_k)):
        for field in ("uniq", "inverse", "counts", "n_uniq", "loc_u"):
            assert_same(getattr(pk, field), getattr(pt, field), f"batch {i} {field}")
    for name in ("slot_ids", "slot_freq", "slot_last_use", "dirty"):  # the trailing dump elements hold nothing
        assert_same(getattr(cache_k, name)[:32], getattr(cache_t, name)[:32], name)
    assert_same(cache_k.stats, cache_t.stats, "stats")
    assert_same(cache_k.rows.data, cache_t.rows.data, "rows")
    every_id = torch.arange(-1, 121, device=DEVICE)
    for cache in (cache_t, cache_k):
        found = cache.slots_of(every_id)  # the live index: the hash index, or the host map (host counts)
        resident = torch.full((122,), -1, dtype=torch.int64, device=DEVICE)
        live = cache.slot_ids[:32] >= 0
        resident[cache.slot_ids[:32][live] + 1] = torch.arange(32, device=DEVICE)[live]
        assert_same(found, resident, "index answers")


# ---------------------------------------------------------------- GPU only: large cases, pinned host memory


@needs_gpu
def test_gpu_large_unique_lookup_victims():
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 1 << 20, (1 << 20,), device="cuda", generator=g)
    for what, a, b in zip(("uniq", "inverse", "counts", "n"), unique_ids_triton(ids, 0), unique_ids_torch(ids, 0)):
        assert_same(a, b, what)
    keys, slots, _ = make_index(1 << 18, 200_000, seed=5)
    keys, slots = keys.cuda(), slots.cuda()
    query = torch.randint(-1, 1 << 20, (1 << 20,), device="cuda", generator=g)
    n = torch.tensor([900_000], device="cuda")
    assert_same(slot_lookup_triton(keys, slots, query, n), slot_lookup_torch(keys, slots, query, n), "slots")
    score = scores("policy_like", 1 << 20, seed=9).cuda()
    k = 50_000
    assert_same(victim_select_triton(score, k), victim_select_torch(score, k), "victims")
    score = scores("wide", 1 << 20, seed=10).cuda()
    assert_same(victim_select_triton(score, 1 << 19), victim_select_torch(score, 1 << 19), "victims wide")


@needs_gpu
@pytest.mark.parametrize("mode", ["zero_copy", "staged"])
def test_gpu_row_copy_pinned_both_directions(mode, monkeypatch):
    monkeypatch.setenv("CACHEDEMB_ROW_COPY", mode)
    rows, dim, cap = 1 << 18, 128, 1 << 16
    host = torch.randn(rows, dim).pin_memory()
    dev_rows = torch.full((cap + 1, dim), float("nan"), device="cuda")
    ids = torch.randperm(rows, device="cuda")[:cap]
    ids[::7] = -1
    slots = torch.randperm(cap, device="cuda")
    n = torch.tensor([cap - 100], device="cuda")
    ref = dev_rows.clone()
    row_copy_torch(host, ids, ref, slots, n)
    row_copy_triton(host, ids, dev_rows, slots, n)  # host -> device
    torch.cuda.synchronize()
    assert_same(dev_rows, ref, "host->device")
    dev_rows.nan_to_num_(-5.0)
    host_ref = host.clone()
    row_copy_torch(dev_rows, slots, host_ref, ids, n)
    row_copy_triton(dev_rows, slots, host, ids, n)  # device -> host
    torch.cuda.synchronize()
    assert_same(host, host_ref, "device->host")
