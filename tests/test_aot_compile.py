"""Every Triton kernel the library launches compiles for H100 (sm_90) and A100 (sm_80) without register spills,
checked without a GPU: the launches of a representative workload are recorded (`cachedemb.tools.aot`), and each
distinct variant (argument types, constexprs, num_warps) is compiled to a cubin with Triton's own ptxas.
A kernel added to kernels/ that the workload does not launch fails the coverage test."""
import os

import pytest
import torch
import triton
import triton.language as tl

from cachedemb.tools import aot

ARCHS = (90, 80)
_MISSING = aot.toolchain_missing()

pytestmark = [
    pytest.mark.skipif(_MISSING is not None, reason=f"cannot compile for NVIDIA GPUs here: {_MISSING}"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available(),
                       reason="running the library's Triton launches on CPU needs TRITON_INTERPRET=1"),
]


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def recording():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACHEDEMB_BACKEND", "triton")
        mp.setenv("CACHEDEMB_GPU_SHAPES", "1")  # the block shapes a GPU launches, not the interpreter's
        with aot.LaunchRecorder() as rec:
            aot.library_workload(_device())
    return rec


@pytest.fixture(scope="module")
def compiled(recording):
    return aot.compile_variants(recording.variants, ARCHS, jobs=2)


def test_the_workload_launches_every_kernel(recording):
    expected = aot.launched_kernels()
    assert expected, "found no launched @triton.jit kernel in cachedemb.kernels"
    missing = sorted(expected - recording.kernels)
    assert not missing, f"launched in kernels/ but not by cachedemb.tools.aot.library_workload (extend it): {missing}"
    assert recording.kernels == expected, f"recorded but not found in kernels/: {recording.kernels - expected}"


def test_every_variant_compiles(recording, compiled):
    assert len(compiled) == len(recording.variants) * len(ARCHS)
    errors = [f"{r['arch']} {r['label']}:\n{r['error']}" for r in compiled if "error" in r]
    assert not errors, f"{len(errors)} of {len(compiled)} compiles failed:\n" + "\n\n".join(errors)


def test_no_variant_spills(compiled):
    spills = [f"{r['arch']} {r['label']}: {r['registers']} registers, stack {r['stack_bytes']} B, "
              f"local {r['local_bytes']} B" for r in compiled if r.get("spills")]
    assert not spills, f"{len(spills)} variants spill registers:\n" + "\n".join(spills)


@triton.jit(do_not_specialize=["m"])
def _probe_kernel(x, n, m, f, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x + o, tl.zeros([BLOCK], dtype=tl.float32) + f + n + m)


def test_the_recorder_specializes_arguments_as_the_jit_does():
    x = torch.zeros(16, device=_device())
    with aot.LaunchRecorder(prefixes=(_probe_kernel.fn.__module__,)) as rec:
        _probe_kernel[(1,)](x, 1, 1, 0.5, BLOCK=16, num_warps=2)
        _probe_kernel[(1,)](x, 1, 1, 0.5, BLOCK=16, num_warps=2)
        _probe_kernel[(1,)](x, 2**40, 32, 0.5, BLOCK=16)
    ones, big = rec.variants
    assert rec.launches[ones] == 2
    # an int equal to 1 becomes a constexpr, except where do_not_specialize says otherwise
    assert dict(ones.signature) == {"x": "*fp32", "n": "constexpr", "m": "i32", "f": "fp32", "BLOCK": "constexpr"}
    assert dict(ones.constexprs) == {"n": 1, "BLOCK": 16} and dict(ones.options) == {"num_warps": 2}
    assert dict(big.signature)["n"] == "i64" and dict(big.signature)["m"] == "i32"
    assert set(big.divisible) == {"x", "n"}  # 32 would be too, but m is not specialized
    assert aot.KernelVariant.from_json(big.to_json()) == big
