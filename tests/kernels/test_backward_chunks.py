"""Backward of hot ids: a group longer than `chunk` lookups is split into chunks reduced into partial sums by
separate programs, added in chunk order (segment_partials_kernel, unique_grad), under persistent grids that
loop to a device-side count; and the lookup grouping taken from unique_ids' own sort.

Checked against: a Python emulation of the same reduction order (bitwise, block_l = 1), the torch reference
(tolerance: another fp32 order), a float64 reference, and repeated runs (bitwise).
"""
import os

import pytest
import torch

from cachedemb import kernels
from cachedemb.kernels import MODE_MAX, MODE_MEAN, MODE_SUM, UpdateRule
from cachedemb.kernels.bag_backward import (
    _bag_backward_triton,
    bag_backward_triton,
    bag_of_lookup,
    lookup_groups,
    lookup_scale,
    segment_chunks,
)
from cachedemb.kernels.sparse_update import _backward_update_triton, backward_update_triton
from cachedemb.kernels.unique_ids import unique_ids_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="CPU cases run the Triton kernels under TRITON_INTERPRET=1")


def hot_batch(n_lookups=300, hot_share=0.9, n_ids=9, dim=8, bag_len=3, pad_id=None, seed=0):
    """Id 1 takes `hot_share` of the lookups, the rest spread over n_ids ids; bags of bag_len lookups."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.where(torch.rand(n_lookups, generator=g) < hot_share, 1,
                      torch.randint(0, n_ids, (n_lookups,), generator=g))
    offsets = torch.arange(0, n_lookups + 1, bag_len)
    offsets[-1] = n_lookups
    _, inverse, _, n_uniq = kernels.unique_ids_torch(ids, padding_idx=pad_id)
    grad_out = torch.randn(offsets.numel() - 1, dim, generator=g)
    psw = torch.rand(n_lookups, generator=g) + 0.5
    return ids, inverse, offsets, n_uniq, grad_out, psw


def emulated_chunk_order(grad_out, inverse, offsets, mode, psw, chunk):
    """Brute force, in the kernel's order at block_l = 1: each group summed lookup by lookup in lookup order; a
    group longer than `chunk` summed per chunk, then the chunk sums added in chunk order."""
    n_lookups, dim = inverse.numel(), grad_out.shape[1]
    bag = bag_of_lookup(offsets, n_lookups)
    contrib = grad_out[bag] * lookup_scale(inverse, offsets, mode, psw).unsqueeze(1)
    out = torch.zeros(n_lookups, dim)
    for j in range(int(inverse.max()) + 1):
        members = (inverse == j).nonzero().flatten().tolist()
        pieces = [members[i:i + chunk] for i in range(0, len(members), chunk)] if len(members) > chunk else [members]
        partials = []
        for piece in pieces:
            acc = torch.zeros(dim)
            for i in piece:
                acc = acc + contrib[i]
            partials.append(acc)
        total = torch.zeros(dim)
        for p in partials:
            total = total + p
        out[j] = total
    return out


def test_segment_chunks_brute_force():
    lengths = [0, 3, 9, 1, 20, 8, 17, 0]
    ptr = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    cptr, chunk_seg = segment_chunks(ptr, sum(lengths), 8)
    expect = [-(-n // 8) if n > 8 else 0 for n in lengths]
    assert cptr.tolist() == [0] + torch.tensor(expect).cumsum(0).tolist()
    owners = [j for j, c in enumerate(expect) for _ in range(c)]
    assert chunk_seg.numel() == 2 * sum(lengths) // 8 >= len(owners)
    assert chunk_seg[:len(owners)].tolist() == owners


@pytest.mark.parametrize("mode_name", ["sum_psw", "mean"])
def test_chunked_bag_backward_is_the_chunk_order_bitwise(mode_name):
    mode = MODE_SUM if mode_name == "sum_psw" else MODE_MEAN
    _, inverse, offsets, _, grad_out, psw = hot_batch(pad_id=4)
    psw = psw if mode == MODE_SUM else None
    n = int(inverse.max()) + 1
    got = _bag_backward_triton(grad_out, inverse, offsets, mode, psw, None, block_l=1, n_rows=n, chunk=32)
    assert torch.equal(got, emulated_chunk_order(grad_out, inverse, offsets, mode, psw, 32)[:n])
    ref = kernels.bag_backward_torch(grad_out, inverse, offsets, mode, psw)[:n]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("mode_name", ["sum", "max"])
def test_chunked_bag_backward_tiled(mode_name):
    """block_l = 16 (the GPU tiling) with chunks: close to the reference, far from the unchunked bits only by
    order; two runs give the same bits."""
    mode = MODE_SUM if mode_name == "sum" else MODE_MAX
    ids, inverse, offsets, _, grad_out, _ = hot_batch(n_lookups=640, seed=1)
    max_pos = None
    if mode == MODE_MAX:
        rows = torch.randn(16, grad_out.shape[1])
        loc_u = torch.arange(inverse.numel()).clamp(max=15)
        _, max_pos = kernels.pooled_forward_torch(rows, loc_u, inverse, offsets, mode)
    args = (grad_out, inverse, offsets, mode, None, max_pos)
    n = int(inverse.max()) + 1
    first = _bag_backward_triton(*args, block_l=16, n_rows=n, chunk=64)
    again = _bag_backward_triton(*args, block_l=16, n_rows=n, chunk=64)
    assert torch.equal(first, again)
    exact = kernels.bag_backward_torch(grad_out.double(), inverse, offsets, mode, None, max_pos)[:n]
    torch.testing.assert_close(first.double(), exact, atol=2e-5, rtol=2e-6)


RULES = {
    "sgd": UpdateRule("sgd", lr=0.1),
    "rowwise_adagrad": UpdateRule("rowwise_adagrad", lr=0.1, eps=1e-8),
    "adam": UpdateRule("adam", lr=0.1, eps=1e-8, beta1=0.9, beta2=0.999, step_size=0.05),
}


@pytest.mark.parametrize("rule_name", list(RULES))
def test_chunked_backward_update_one_hot_id(rule_name):
    """One id takes 95% of 640 lookups, split into 10 chunks of 64 (tiles of 16): repeated runs are
    bit-identical; against a float64 reduction the updated rows stay within a few fp32 ulps; rows and states
    untouched by the batch keep their bits."""
    rule = RULES[rule_name]
    _, inverse, offsets, n_uniq, grad_out, psw = hot_batch(n_lookups=640, hot_share=0.95, dim=24, pad_id=0,
                                                           seed=2)
    n = int(n_uniq)
    g = torch.Generator().manual_seed(3)
    n_rows = n + 5
    loc_u = torch.full((inverse.numel(),), -1, dtype=torch.int64)
    loc_u[:n] = torch.randperm(n_rows, generator=g)[:n]
    rows0 = torch.randn(n_rows, 24, generator=g)
    width = {"sgd": [], "rowwise_adagrad": [1], "adam": [24, 24]}[rule_name]
    states0 = [torch.rand(n_rows, w, generator=g) for w in width]

    def run(block_l, chunk, grad=grad_out):
        rows, states = rows0.clone(), [s.clone() for s in states0]
        _backward_update_triton(rows, states, loc_u, n_uniq, grad, inverse, offsets, MODE_SUM, psw, None, rule,
                                block_l=block_l, chunk=chunk)
        return rows, states

    rows, states = run(16, 64)
    rows2, states2 = run(16, 64)
    assert torch.equal(rows, rows2) and all(torch.equal(a, b) for a, b in zip(states, states2))
    ref_rows, ref_states = rows0.double(), [s.double() for s in states0]
    kernels.backward_update_torch(ref_rows, ref_states, loc_u, n_uniq, grad_out.double(), inverse, offsets,
                                  MODE_SUM, psw.double(), None, rule)
    torch.testing.assert_close(rows.double(), ref_rows, atol=1e-5, rtol=1e-5)
    for s, r in zip(states, ref_states):
        torch.testing.assert_close(s.double(), r, atol=1e-5, rtol=1e-5)
    dead = torch.ones(n_rows, dtype=torch.bool)
    dead[loc_u[:n]] = False
    assert torch.equal(rows[dead], rows0[dead])
    # block_l = 1: exactly the emulated chunk order, then the rule (as the reference applies it)
    rows1, _ = run(1, 64)
    grad_u = emulated_chunk_order(grad_out, inverse, offsets, MODE_SUM, psw, 64)
    emu_rows, emu_states = rows0.clone(), [s.clone() for s in states0]
    kernels.sparse_update_torch(emu_rows, emu_states, loc_u, grad_u, n_uniq, rule)
    torch.testing.assert_close(rows1, emu_rows, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pad_id", [None, 0, 3, 8])
def test_unique_ids_groups_are_lookup_groups(pad_id):
    """The grouping unique_ids derives from its own sort equals a fresh stable sort of the inverse, and the
    fused backward given it updates the same bits."""
    ids, inverse, offsets, _, grad_out, _ = hot_batch(n_lookups=120, hot_share=0.3, n_ids=9, pad_id=pad_id,
                                                      seed=4)
    uniq, inv, counts, n_uniq, (perm, ptr) = unique_ids_triton(ids, pad_id, return_groups=True)
    ref_perm, ref_ptr = lookup_groups(inverse)
    assert torch.equal(inv, inverse)
    assert torch.equal(perm, ref_perm) and torch.equal(ptr, ref_ptr)
    ref = kernels.unique_ids_torch(ids, pad_id, return_groups=True)
    assert all(torch.equal(a, b) for a, b in zip(ref[4], (perm, ptr)))
    n = int(n_uniq)
    loc_u = torch.full((ids.numel(),), -1, dtype=torch.int64)
    loc_u[:n] = torch.arange(n)
    rule = RULES["adam"]
    out = []
    for groups in (None, (perm, ptr)):
        rows, states = torch.ones(n, 8), [torch.zeros(n, 8), torch.zeros(n, 8)]
        backward_update_triton(rows, states, loc_u, n_uniq, grad_out, inverse, offsets, MODE_SUM, None,
                                       None, rule, groups=groups)
        out.append(rows)
    assert torch.equal(out[0], out[1])
    assert torch.equal(bag_backward_triton(grad_out, inverse, offsets, MODE_MEAN, n_rows=n, groups=(perm, ptr)),
                       kernels.bag_backward_torch(grad_out, inverse, offsets, MODE_MEAN)[:n])


def test_unique_ids_groups_empty_batch():
    empty = torch.zeros(0, dtype=torch.int64)
    *_, (perm, ptr) = unique_ids_triton(empty, None, return_groups=True)
    assert perm.numel() == 0 and ptr.tolist() == [0]
