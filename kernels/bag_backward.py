"""Gradient of the pooled forward, reduced per unique id (duplicates summed once per row).

`grad_u [U, D]` fp32: row j holds the summed gradient of unique id j over all its lookups; rows past n are 0.
sum: each lookup gets grad_out[bag] * per_sample_weight; mean: grad_out[bag] / (non-padding lookups in bag);
max: element d of bag b goes to the lookup at max_pos[b, d] only. Padding lookups get nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import backend_for
from .pooled_forward import MODE_MAX, MODE_MEAN, MODE_SUM, lookup_rows_of


def bag_of_lookup(offsets: torch.Tensor, n_lookups: int) -> torch.Tensor:
    """The bag index of each lookup ([B] int64), without a host sync (output_size is given)."""
    lengths = offsets[1:] - offsets[:-1]
    bags = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(bags, lengths, output_size=n_lookups)


def lookup_scale(inverse, offsets, mode: int, per_sample_weights=None) -> torch.Tensor:
    """Per-lookup factor on grad_out[bag] for sum/mean ([B] fp32; 0 for padding lookups)."""
    n_lookups = inverse.numel()
    valid = (inverse >= 0).float()
    if mode == MODE_MEAN:
        bag = bag_of_lookup(offsets, n_lookups)
        count = torch.zeros(offsets.numel() - 1, device=inverse.device).index_add_(0, bag, valid)
        return valid / count.clamp(min=1)[bag]
    if per_sample_weights is not None:
        return valid * per_sample_weights.float()
    return valid


def bag_backward_torch(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None):
    """Reference segment reduction: returns grad_u [B, D] fp32 (capacity B = lookups)."""
    n_lookups = inverse.numel()
    dim = grad_out.shape[1]
    grad_out = grad_out.float()
    grad_u = torch.zeros(n_lookups, dim, dtype=torch.float32, device=grad_out.device)
    if mode == MODE_MAX:
        if max_pos is None:
            raise ValueError("max mode needs max_pos from the forward")
        has = max_pos >= 0
        target = inverse[max_pos.clamp(min=0)]
        has &= target >= 0
        flat = (target.clamp(min=0) * dim + torch.arange(dim, device=grad_out.device)).reshape(-1)
        grad_u.view(-1).index_add_(0, flat, torch.where(has, grad_out, 0.0).reshape(-1))
        return grad_u
    bag = bag_of_lookup(offsets, n_lookups)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights)
    contrib = grad_out[bag] * scale.unsqueeze(1)
    grad_u.index_add_(0, inverse.clamp(min=0), contrib)
    return grad_u


def unique_grad_torch(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None):
    """grad_u for the live unique ids only ([n, D] fp32; n read on the host). Sum/mean reduce each unique id's
    lookups with torch.embedding_bag over grad_out (no [B, D] intermediate); max falls back to the reference."""
    if mode == MODE_MAX:
        grad_u = bag_backward_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
        n = int(inverse.max()) + 1 if inverse.numel() else 0
        return grad_u[:n]
    perm, ptr = lookup_groups(inverse)
    n = int((ptr[1:] > ptr[:-1]).sum())
    n_lookups = inverse.numel()
    bag = bag_of_lookup(offsets, n_lookups)[perm]
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights)[perm]
    grad_u, _, _, _ = torch.embedding_bag(grad_out.float().contiguous(), bag, ptr[:n], False, MODE_SUM, False,
                                          scale, False, None)
    return grad_u


def lookup_groups(inverse: torch.Tensor):
    """Lookups grouped by unique position, without a host sync: `perm [B]` (a stable sort, so lookup order
    within a group) and `ptr [B + 1]` (group j is perm[ptr[j]:ptr[j+1]]); padding lookups fall in no group."""
    n_lookups = inverse.numel()
    key = torch.where(inverse >= 0, inverse, torch.full_like(inverse, n_lookups))
    sorted_key, perm = torch.sort(key, stable=True)
    ptr = torch.searchsorted(sorted_key, torch.arange(n_lookups + 1, device=inverse.device))
    return perm, ptr


def backward_block_l(device: torch.device) -> int:
    """Lookups reduced per step: 1 keeps the reference's sequential fp32 order (CPU, where the reference is
    sequential too); on the GPU the reference sums in atomic order anyway, so reduce in tiles for bandwidth."""
    return 1 if device.type == "cpu" else 16


@triton.jit
def segment_grad(grad_out, perm, bag, scale, max_pos, bos, eos, o_d, m_d, D,
                 MODE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 gradient [BLOCK_D] of one unique id: the sum over its lookups perm[bos:eos] (lookup order)."""
    b_g = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(bos, eos, BLOCK_L):
        o_k = k + tl.arange(0, BLOCK_L).to(tl.int64)
        m_k = o_k < eos
        b_i = tl.load(perm + o_k, mask=m_k, other=0)
        b_b = tl.load(bag + b_i, mask=m_k, other=0)
        m_t = m_k[:, None] & m_d[None, :]
        o_t = b_b[:, None] * D + o_d[None, :]
        b_go = tl.load(grad_out + o_t, mask=m_t, other=0.0).to(tl.float32)
        if MODE == 2:
            # element d of bag b belongs to the lookup the forward picked as its max
            b_mp = tl.load(max_pos + o_t, mask=m_t, other=-1)
            b_go = tl.where(b_mp == b_i[:, None], b_go, 0.0)
        else:
            b_go = b_go * tl.load(scale + b_i, mask=m_k, other=0.0)[:, None]
        b_g += tl.sum(b_go, axis=0)
    return b_g


@triton.jit
def bag_backward_kernel(
    grad_out,  # [n_bags, D]
    perm,  # [B] int64 lookups sorted by unique position
    ptr,  # [B + 1] int64 group starts
    bag,  # [B] int64 bag of each lookup
    scale,  # [B] fp32 factor on grad_out[bag] per lookup (sum / mean)
    max_pos,  # [n_bags, D] int64 (max mode)
    grad_u,  # [B, D] fp32
    D,
    MODE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_u, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < D
    bos, eos = tl.load(ptr + i_u), tl.load(ptr + i_u + 1)
    b_g = segment_grad(grad_out, perm, bag, scale, max_pos, bos, eos, o_d, m_d, D, MODE, BLOCK_L, BLOCK_D)
    tl.store(grad_u + i_u * D + o_d, b_g, mask=m_d)


def backward_inputs(grad_out, inverse, offsets, mode: int, per_sample_weights, max_pos):
    """What the segment-reduction kernels read besides grad_out: (perm, ptr, bag, scale, max_pos)."""
    n_lookups = inverse.numel()
    if mode == MODE_MAX and max_pos is None:
        raise ValueError("max mode needs max_pos from the forward")
    perm, ptr = lookup_groups(inverse)
    bag = bag_of_lookup(offsets, n_lookups)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights) if mode != MODE_MAX else inverse
    return perm, ptr, bag, scale, (max_pos if mode == MODE_MAX else grad_out)


def _bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, block_l=None):
    n_lookups, dim = inverse.numel(), grad_out.shape[1]
    grad_u = torch.empty(n_lookups, dim, dtype=torch.float32, device=grad_out.device)
    if n_lookups == 0:
        return grad_u
    grad_out = grad_out.contiguous()
    perm, ptr, bag, scale, max_pos = backward_inputs(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
    block_l = block_l or backward_block_l(grad_out.device)
    block_d = min(triton.next_power_of_2(dim), 128)
    grid = (n_lookups, triton.cdiv(dim, block_d))
    bag_backward_kernel[grid](grad_out, perm, ptr, bag, scale, max_pos.contiguous(), grad_u, dim,
                              MODE=mode, BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4 if block_l > 1 else 1)
    return grad_u


def bag_backward_triton(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None):
    """Triton path of bag_backward: one program per (unique position, D-block) sums its lookups' gradients
    (grouped by a sort, no atomics); positions past the unique count have no lookups and get 0."""
    return _bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)


def bag_backward(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None):
    if backend_for(grad_out.device) == "triton":
        return bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
    return bag_backward_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)


def per_sample_weights_grad(grad_out, rows, loc_u, inverse, offsets):
    """d loss / d per_sample_weights (sum mode): <grad_out[bag], row of the lookup>; 0 for padding lookups."""
    n_lookups = inverse.numel()
    bag = bag_of_lookup(offsets, n_lookups)
    lookup_rows = rows.index_select(0, lookup_rows_of(loc_u, inverse)).float()
    dots = (grad_out.float()[bag] * lookup_rows).sum(1)
    return torch.where(inverse >= 0, dots, 0.0)
