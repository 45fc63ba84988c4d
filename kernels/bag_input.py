"""Unvalidated bag input made safe on the device in one launch (as FBGEMM's `bounds_check_indices`).

For a 1-D input of n ids with offsets (validate_inputs=False): offsets are clamped into [0, n] and made
non-decreasing (a running max), and `full [bags + 2]` = [0, offsets..., n] gets a phantom bag at either end
(`extend_last`, include_last_offset with padding_idx or max mode: the last bag runs to the input's end instead,
[0, offsets[:-1]..., n]); ids out of [0, N) and lookups outside every bag (before offsets[0]; with `trail`, at or
past offsets[-1]) become `pad_id`. For a 2-D input ([bags, width], offsets None) `full` = arange(bags + 1) x width
and only the range is checked. `invalid` ([2] int64, added to) counts the ids made padding (outside lookups
excluded) and the offsets changed. Program 0 repairs the offsets (one sequential scan), the others the ids.
"""

import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gpu_shapes, on_device


def full_offsets_size(n_offs: int, two_d_bags: int | None, extend_last: bool) -> int:
    if two_d_bags is not None:
        return two_d_bags + 1
    return n_offs + (1 if extend_last else 2)


def bag_repair_torch(ids, offsets, num_embeddings: int, pad_id: int, width: int, trail: bool, extend_last: bool,
                     invalid, out_ids, out_full) -> None:
    """Reference. `offsets` None: a 2-D input of rows of `width` ids."""
    n = ids.numel()
    dev = out_ids.device
    if offsets is None:
        out_full.copy_(torch.arange(out_full.numel(), device=dev, dtype=torch.int64) * width)
        lo = hi = None
        bad_offsets = torch.zeros((), dtype=torch.int64, device=dev)
    else:
        offs = offsets.to(device=dev, dtype=torch.int64)
        fixed = torch.cummax(offs.clamp(0, n), 0).values
        bad_offsets = (fixed != offs).sum()
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        end = torch.full((1,), n, dtype=torch.int64, device=dev)
        out_full.copy_(torch.cat([zero, fixed[:-1], end]) if extend_last else torch.cat([zero, fixed, end]))
        lo = out_full[1]
        hi = out_full[-2] if trail else None
    ids = ids.reshape(-1).to(device=dev, dtype=torch.int64)
    out_of_range = (ids < 0) | (ids >= num_embeddings)
    position = torch.arange(n, device=dev)
    outside = torch.zeros_like(out_of_range) if lo is None else position < lo
    if hi is not None:
        outside |= position >= hi
    out_ids.copy_(torch.where(out_of_range | outside, torch.full_like(ids, pad_id), ids))
    invalid[0] += (out_of_range & outside.logical_not()).sum()
    invalid[1] += bad_offsets


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["n", "n_offs", "n_full", "num_embeddings", "pad_id", "width"])
def bag_repair_kernel(p_ids, p_offs, o_ids, o_full, p_invalid, n, n_offs, n_full, num_embeddings, pad_id, width,
                      TWO_D: tl.constexpr, TRAIL: tl.constexpr, EXTEND_LAST: tl.constexpr, BLOCK: tl.constexpr,
                      SCAN: tl.constexpr):
    i_p = tl.program_id(0)
    if i_p == 0:
        if TWO_D:
            for j in range(0, n_full, SCAN):
                o_j = j + tl.arange(0, SCAN).to(tl.int64)
                tl.store(o_full + o_j, o_j * width, mask=o_j < n_full)
        else:
            # full = [0, running max of the clamped offsets..., n] (extend_last: the last offset replaced by n)
            b_carry = tl.zeros([], dtype=tl.int64)
            n_bad = tl.zeros([], dtype=tl.int64)
            tl.store(o_full, b_carry)
            tl.store(o_full + n_full - 1, b_carry + n)
            n_keep = n_offs - 1 if EXTEND_LAST else n_offs
            for j in range(0, n_offs, SCAN):
                o_j = j + tl.arange(0, SCAN).to(tl.int64)
                m_j = o_j < n_offs
                b_o = tl.load(p_offs + o_j, mask=m_j, other=0).to(tl.int64)
                b_fix = tl.maximum(tl.associative_scan(tl.minimum(tl.maximum(b_o, 0), n), 0, _max), b_carry)
                n_bad += tl.sum((m_j & (b_fix != b_o)).to(tl.int64), 0)
                tl.store(o_full + 1 + o_j, b_fix, mask=o_j < n_keep)
                b_carry = tl.maximum(b_carry, tl.max(tl.where(m_j, b_fix, 0), 0))
            tl.atomic_add(p_invalid + 1, n_bad, sem="relaxed")
    else:
        o_i = (i_p - 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m_i = o_i < n
        b_id = tl.load(p_ids + o_i, mask=m_i, other=0).to(tl.int64)
        m_bad = (b_id < 0) | (b_id >= num_embeddings)
        m_out = m_i & (m_i == 0)
        if not TWO_D:
            # the first bag starts at the clamped offsets[0] (n without offsets); with TRAIL the lookups from the
            # clamped running max's end (the largest clamped offset) on are outside too
            lo = tl.where(n_offs > 0, tl.minimum(tl.maximum(tl.load(p_offs, mask=n_offs > 0, other=0).to(tl.int64),
                                                            0), n), n)
            m_out = o_i < lo
            if TRAIL:
                hi = tl.zeros([], dtype=tl.int64)
                for j in range(0, n_offs, SCAN):
                    o_j = j + tl.arange(0, SCAN).to(tl.int64)
                    b_o = tl.load(p_offs + o_j, mask=o_j < n_offs, other=0).to(tl.int64)
                    hi = tl.maximum(hi, tl.max(tl.minimum(tl.maximum(b_o, 0), n), 0))
                m_out = m_out | (o_i >= hi)
        tl.store(o_ids + o_i, tl.where(m_bad | m_out, pad_id, b_id), mask=m_i)
        tl.atomic_add(p_invalid, tl.sum((m_i & m_bad & (m_out == 0)).to(tl.int64), 0), sem="relaxed")


def bag_repair_triton(ids, offsets, num_embeddings: int, pad_id: int, width: int, trail: bool, extend_last: bool,
                      invalid, out_ids, out_full) -> None:
    n = ids.numel()
    dev = out_ids.device
    block = min(1024 if gpu_shapes(dev) else 16384, max(16, triton.next_power_of_2(max(n, 1))))
    n_offs = 0 if offsets is None else offsets.numel()
    scan = min(1024 if gpu_shapes(dev) else 16384, max(16, triton.next_power_of_2(max(n_offs, out_full.numel(), 1))))
    offs = ids if offsets is None or n_offs == 0 else offsets.contiguous()
    bag_repair_kernel[(1 + triton.cdiv(n, block),)](
        ids.reshape(-1).contiguous(), offs, out_ids, out_full, invalid, n, n_offs, out_full.numel(), num_embeddings,
        pad_id, width, TWO_D=offsets is None, TRAIL=trail, EXTEND_LAST=extend_last, BLOCK=block, SCAN=scan)


def bag_repair(ids, offsets, num_embeddings: int, pad_id: int, width: int, trail: bool, extend_last: bool, invalid,
               out_ids, out_full) -> None:
    if backend_for(out_ids.device) == "triton" and ids.device == out_ids.device and \
            (offsets is None or offsets.device == out_ids.device):
        with on_device(out_ids):
            return bag_repair_triton(ids, offsets, num_embeddings, pad_id, width, trail, extend_last, invalid,
                                     out_ids, out_full)
    return bag_repair_torch(ids, offsets, num_embeddings, pad_id, width, trail, extend_last, invalid, out_ids,
                            out_full)
