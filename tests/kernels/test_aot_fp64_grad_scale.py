"""The kernel variants that float64 tables and grad_scale_u add compile for sm_90 / sm_80 (cachedemb.tools.aot, no GPU
needed): the library workload of tests/test_aot_compile.py runs neither an fp64 table nor a gradient scale, so
their launches are recorded here, at the GPU's block shapes, and compiled with Triton's ptxas. fp64 variants must
not spill; a scaled variant may spill only where its unscaled twin (same launch, HAS_GSCALE=False) already does
(max-mode row-wise Adagrad over 64-column tiles spills on sm_80 with and without the scale)."""
import json
import os

import pytest
import torch

from cachedemb import kernels
from cachedemb.tools import aot

from .test_fp64_grad_scale import MODES, RULES, Case, acc_dtype_of, make_states, max_pos_of

ARCHS = (90, 80)
_MISSING = aot.toolchain_missing()
pytestmark = [
    pytest.mark.skipif(_MISSING is not None, reason=f"cannot compile for NVIDIA GPUs here: {_MISSING}"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available(),
                       reason="running the Triton launches on CPU needs TRITON_INTERPRET=1"),
]
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
SMALL = dict(lengths=(0, 3, 1, 6), n_ids=6, pad=2, n_table=12, n_slots=16)


def workload():
    """fp64: every op, every mode and rule, with and without the scale; fp32 / bf16: the scaled backward ops."""
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        fp64, acc = dtype == torch.float64, acc_dtype_of(dtype)
        for dim in (7, 129):
            for mode, use_psw in MODES.values():
                psw_of = (lambda c: c.psw) if use_psw else (lambda c: None)
                c = Case(dim, dtype, **SMALL).to(DEVICE)
                if fp64:
                    kernels.pooled_forward(c.rows, c.loc_u, c.inverse, c.offsets, mode, psw_of(c), c.host_rows)
                for scale in (None, c.grad_scale_u(acc)) if fp64 else (c.grad_scale_u(acc),):
                    kernels.bag_backward(c.grad_out, c.inverse, c.offsets, mode, psw_of(c), max_pos_of(c, mode),
                                         grad_scale_u=scale)
                    for rule_name, rule in RULES.items():
                        c = Case(dim, dtype, **SMALL).to(DEVICE)
                        _, states, host_states = make_states(c, rule_name, acc)
                        kernels.backward_update(c.rows, states, c.loc_u, c.n_uniq, c.grad_out, c.inverse, c.offsets,
                                                mode, psw_of(c), max_pos_of(c, mode), rule, c.host_rows, host_states,
                                                grad_scale_u=scale)
            if not fp64:
                continue
            c = Case(dim, dtype, host_every=0, **SMALL).to(DEVICE)
            kernels.per_sample_weights_grad(c.grad_out, c.rows, c.loc_u, c.inverse, c.offsets, c.host_rows)
            for rule_name, rule in RULES.items():
                _, states, _ = make_states(c, rule_name)
                grad_u = torch.randn(c.inverse.numel(), dim, dtype=dtype, device=DEVICE)
                kernels.sparse_update(c.rows, states, c.loc_u, grad_u, c.n_uniq, rule)
            src = torch.randn(20, dim, dtype=dtype, device=DEVICE)
            kernels.row_copy(src, torch.arange(12, device=DEVICE), torch.zeros(30, dim, dtype=dtype, device=DEVICE),
                             torch.arange(12, device=DEVICE), torch.tensor([9], device=DEVICE))


@pytest.fixture(scope="module")
def compiled():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACHEDEMB_BACKEND", "triton")
        mp.setenv("CACHEDEMB_GPU_SHAPES", "1")
        with aot.LaunchRecorder() as rec:
            workload()
    variants = rec.variants
    twins = {}
    for v in variants:
        consts = dict(v.constexprs)
        if consts.get("HAS_GSCALE"):
            d = v.to_json()
            d["constexprs"] = {**d["constexprs"], "HAS_GSCALE": False}
            twins[v] = aot.KernelVariant.from_json(json.loads(json.dumps(d)))
    extra = [t for t in dict.fromkeys(twins.values()) if t not in set(variants)]
    results = aot.compile_variants(variants + extra, ARCHS, jobs=2)
    by_key = {(r["label"], r["arch"]): r for r in results}
    return variants, twins, results, by_key


def is_fp64(v):
    return any(isinstance(x, dict) and x.get("dtype") == "fp64" for _, x in v.constexprs) or any(
        t == "*fp64" for _, t in v.signature)


def test_the_new_variants_are_recorded(compiled):
    variants, twins, _, _ = compiled
    kinds = {(v.name, is_fp64(v)) for v in variants}
    for name in ("pooled_forward_kernel", "bag_backward_kernel", "psw_grad_kernel", "sparse_update_kernel",
                 "backward_update_kernel", "row_copy_kernel"):
        assert (name, True) in kinds, f"no fp64 launch of {name} recorded"
    assert {v.name for v in twins} == {"bag_backward_kernel", "backward_update_kernel"}
    assert any(not is_fp64(v) for v in twins), "no scaled fp32 / bf16 launch recorded"


def test_every_new_variant_compiles(compiled):
    _, _, results, _ = compiled
    errors = [f"{r['arch']} {r['label']}:\n{r['error']}" for r in results if "error" in r]
    assert not errors, f"{len(errors)} of {len(results)} compiles failed:\n" + "\n\n".join(errors)


def test_fp64_variants_do_not_spill(compiled):
    variants, _, _, by_key = compiled
    spills = [f"{arch} {v.label}: {by_key[(v.label, arch)]['registers']} registers" for v in variants if is_fp64(v)
              for arch in (f"sm_{a}" for a in ARCHS) if by_key[(v.label, arch)].get("spills")]
    assert not spills, f"{len(spills)} fp64 variants spill:\n" + "\n".join(spills)


def test_the_scale_adds_no_spill(compiled):
    _, twins, _, by_key = compiled
    added = []
    for v, twin in twins.items():
        for arch in (f"sm_{a}" for a in ARCHS):
            if by_key[(v.label, arch)].get("spills") and not by_key[(twin.label, arch)].get("spills"):
                added.append(f"{arch} {v.label}")
    assert not added, f"{len(added)} scaled variants spill where the unscaled ones do not:\n" + "\n".join(added)
