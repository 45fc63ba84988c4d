"""row_move (an admission's row moves: dirty victims out, misses in) on the Triton backend, split into an out and
an in launch (the default) and fused into one, against the pure-torch reference row_move_torch. Copies and
count moves are exact: every comparison is bitwise."""
import importlib
import os

import pytest
import torch

from cachedemb.kernels.row_copy import row_move, row_move_fused_triton, row_move_split_triton, row_move_torch

row_copy = importlib.import_module("cachedemb.kernels.row_copy")  # the package exports a function of that name

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="CPU cases run the Triton kernels under TRITON_INTERPRET=1")

VARIANTS = {"split": row_move_split_triton, "fused": row_move_fused_triton}


def admission(n_host=400, n_slots=96, dim=64, n_states=0, k=40, n_miss=55, dtype=torch.float32, shuffle=False,
              seed=0):
    """A cache-shaped move: host tables (rows of `dtype`, fp32 states of widths dim and 1, int64 counts), device
    tables, k victims (some empty, some clean), n_miss missing ids of which the first k take the victims' slots
    (the rest served from the host: no slot), and the batch's lookups per miss (`add`). `shuffle`: the misses
    take the victims' slots in another order (no longer rank r -> victim r: only the split launches and the
    reference, out entirely before in, allow it)."""
    g = torch.Generator().manual_seed(seed)
    widths = (dim, 1)[:n_states]
    host = [torch.randn(n_host, dim, generator=g).to(dtype)] + [torch.rand(n_host, w, generator=g) for w in widths]
    dev = [torch.randn(n_slots, dim, generator=g).to(dtype)] + [torch.rand(n_slots, w, generator=g) for w in widths]
    host_freq = torch.randint(0, 1000, (n_host,), generator=g)
    slot_freq = torch.randint(0, 1000, (n_slots,), generator=g)
    perm = torch.randperm(n_host, generator=g)
    old_ids = perm[:k].clone()
    old_ids[::7] = -1  # empty slots: no count back
    dirty_ids = torch.where(torch.rand(k, generator=g) < 0.6, old_ids, torch.full_like(old_ids, -1))
    victims = torch.randperm(n_slots, generator=g)[:k]
    cap = n_miss + 1
    miss_ids = torch.full((cap,), -1, dtype=torch.int64)
    miss_ids[:n_miss] = perm[k:k + n_miss]  # never resident: disjoint from the victims' ids
    miss_dest = torch.full((cap,), -1, dtype=torch.int64)
    admitted = min(k, n_miss)
    miss_dest[:admitted] = victims[torch.randperm(k, generator=g)[:admitted]] if shuffle else victims[:admitted]
    add = torch.randint(1, 5, (cap,), generator=g)
    pairs = list(zip(dev, host))
    return dict(pairs=pairs, slot_freq=slot_freq, host_freq=host_freq, victims=victims,
                n_admit=torch.tensor([admitted]), old_ids=old_ids, dirty_ids=dirty_ids, miss_ids=miss_ids,
                miss_dest=miss_dest, n_miss=torch.tensor([n_miss]), add=add)


def cloned(a):
    out = dict(a)
    out["pairs"] = [(d.clone(), h.clone()) for d, h in a["pairs"]]
    out["slot_freq"], out["host_freq"] = a["slot_freq"].clone(), a["host_freq"].clone()
    return out


def tables(a):
    ts = [t for pair in a["pairs"] for t in pair] + [a["slot_freq"], a["host_freq"]]
    return [t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t for t in ts]


def run(fn, a, with_add=True):
    fn(a["pairs"], a["slot_freq"], a["host_freq"], a["victims"], a["n_admit"], a["old_ids"], a["dirty_ids"],
       a["miss_ids"], a["miss_dest"], a["n_miss"], a["add"] if with_add else None)


def assert_same(a, b):
    for i, (x, y) in enumerate(zip(tables(a), tables(b))):
        assert torch.equal(x, y), f"table {i} differs at {(x != y).nonzero()[:5].flatten().tolist()}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("n_states", [0, 1, 2], ids=["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("dim,dtype", [(64, torch.float32), (128, torch.bfloat16), (128, torch.float32),
                                       (7, torch.float32), (129, torch.float16)],
                         ids=["256B-fp32", "256B-bf16", "512B-fp32", "dim7", "dim129-fp16"])
def test_row_move_equals_the_reference(variant, n_states, dim, dtype):
    a = admission(dim=dim, n_states=n_states, dtype=dtype, seed=n_states)
    ref, got = cloned(a), cloned(a)
    run(row_move_torch, ref)
    run(VARIANTS[variant], got)
    assert_same(got, ref)
    # the move did move something: every admitted miss's row is in its slot, every dirty victim's row went out
    moved = a["miss_dest"][: int(a["n_admit"])]
    assert torch.equal(got["pairs"][0][0][moved], a["pairs"][0][1][a["miss_ids"][: moved.numel()]])
    dirty = a["dirty_ids"] >= 0
    assert torch.equal(got["pairs"][0][1][a["dirty_ids"][dirty]], a["pairs"][0][0][a["victims"][dirty]])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", ["int-counts", "no-add", "more-misses-than-victims", "fewer-misses", "zero",
                                  "count-past-cap", "out-only", "in-only"])
def test_row_move_counts_and_edges(variant, case):
    a = admission(n_miss=30 if case == "fewer-misses" else 55, seed=3)
    if case == "int-counts":
        a["n_admit"], a["n_miss"] = int(a["n_admit"]), int(a["n_miss"])
    if case == "zero":
        a["n_admit"], a["n_miss"] = torch.tensor([0]), torch.tensor([0])
    if case == "out-only":  # the benchmark's one-direction moves
        a["n_miss"] = torch.tensor([0])
    if case == "in-only":
        a["n_admit"] = torch.tensor([0])
    if case == "count-past-cap":  # counts are clamped to the buffers' length
        a["n_admit"], a["n_miss"] = torch.tensor([10**6]), torch.tensor([10**6])
        a["miss_dest"][a["miss_dest"] < 0] = -1
    ref, got = cloned(a), cloned(a)
    run(row_move_torch, ref, with_add=case != "no-add")
    run(VARIANTS[variant], got, with_add=case != "no-add")
    assert_same(got, ref)


def test_split_moves_all_rows_out_before_any_in():
    """Misses landing in other ranks' victim slots: the split launches (out, then in) still equal the reference;
    the fused launch, rank by rank, is only for rank r -> victim r."""
    a = admission(shuffle=True, n_states=1, seed=5)
    ref, got = cloned(a), cloned(a)
    run(row_move_torch, ref)
    run(row_move_split_triton, got)
    assert_same(got, ref)


def test_out_of_range_indices_are_skipped():
    a = admission(seed=7)
    a["dirty_ids"][1] = 10**6  # past the host table
    a["miss_ids"][2] = 10**6
    a["miss_dest"][2] = -1  # host-served: an invalid id never gets a slot
    a["victims"][4] = 10**5  # past the cache
    a["old_ids"][4] = -1
    a["dirty_ids"][4] = -1
    for fn in VARIANTS.values():
        ref, got = cloned(a), cloned(a)
        run(row_move_torch, ref)
        run(fn, got)
        assert_same(got, ref)


def test_dispatch_follows_the_mode(monkeypatch):
    calls = []
    for name in ("row_move_split_triton", "row_move_fused_triton"):
        real = getattr(row_copy, name)
        monkeypatch.setattr(row_copy, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a)))
    monkeypatch.setenv("CACHEDEMB_BACKEND", "triton")
    a = admission(seed=9)
    for mode in ("split", "fused", ""):
        monkeypatch.setenv("CACHEDEMB_ROW_MOVE", mode)
        got, ref = cloned(a), cloned(a)
        run(row_move, got)
        run(row_move_torch, ref)
        assert_same(got, ref)
    assert calls == ["row_move_split_triton", "row_move_fused_triton", "row_move_split_triton"]
    monkeypatch.setenv("CACHEDEMB_ROW_MOVE", "both")
    with pytest.raises(ValueError, match="CACHEDEMB_ROW_MOVE='both'"):
        run(row_move, cloned(a))



def test_the_row_move_benchmark_smoke_run_checks_every_variant(tmp_path):
    """bench_kernels.py --row-move --smoke: every (variant, direction, row size) moved as the reference does."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "row_move.json"
    proc = subprocess.run([sys.executable, str(root / "scripts" / "bench_kernels.py"), "--row-move", "--smoke",
                           "--out", str(out)], capture_output=True, text=True, env={**os.environ,
                                                                                   "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert report["meta"]["smoke"] and {(r["variant"], r["direction"], r["row_bytes"]) for r in rows} == {
        (v, d, b) for v in ("split", "fused") for d in ("in", "out", "both") for b in (256, 512)}
    assert all(r["equal_to_reference"] for r in rows), [r for r in rows if not r["equal_to_reference"]]
    refused = subprocess.run([sys.executable, str(root / "scripts" / "bench_kernels.py"), "--row-move"],
                             capture_output=True, text=True)
    if not __import__("torch").cuda.is_available():
        assert refused.returncode == 2 and "needs a CUDA device" in refused.stderr
