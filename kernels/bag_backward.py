"""Gradient of the pooled forward, reduced per unique id (duplicates summed once per row).

`grad_u [U, D]` fp32 (fp64 for an fp64 grad_out, `acc_dtype`): row j holds the summed gradient of unique id j
over all its lookups; rows past n are 0. sum: each lookup gets grad_out[bag] * per_sample_weight; mean:
grad_out[bag] / (non-padding lookups in bag); max: element d of bag b goes to the lookup at max_pos[b, d] only.
Padding lookups get nothing. `grad_scale_u [U]` (optional, e.g. 1 / count for `scale_grad_by_freq`) multiplies
row j's sum by grad_scale_u[j]; entries past the unique count are never read.
"""

import torch
import triton
import triton.language as tl

from .dispatch import backend_for, gpu_shapes, on_device
from .pooled_forward import MODE_MAX, MODE_MEAN, MODE_SUM, acc_dtype, lookup_rows_of, tl_acc_dtype, with_host_rows


def bag_of_lookup(offsets: torch.Tensor, n_lookups: int) -> torch.Tensor:
    """The bag index of each lookup ([B] int64), without a host sync (output_size is given)."""
    lengths = offsets[1:] - offsets[:-1]
    bags = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(bags, lengths, output_size=n_lookups)


def lookup_scale(inverse, offsets, mode: int, per_sample_weights=None, dtype=torch.float32) -> torch.Tensor:
    """Per-lookup factor on grad_out[bag] for sum/mean ([B] `dtype`; 0 for padding lookups)."""
    n_lookups = inverse.numel()
    valid = (inverse >= 0).to(dtype)
    if mode == MODE_MEAN:
        bag = bag_of_lookup(offsets, n_lookups)
        count = torch.zeros(offsets.numel() - 1, device=inverse.device, dtype=dtype).index_add_(0, bag, valid)
        return valid / count.clamp(min=1)[bag]
    if per_sample_weights is not None:
        return valid * per_sample_weights.to(dtype)
    return valid


def scale_live_rows(grad_u, inverse, grad_scale_u):
    """Reference: multiply row j of grad_u [B, D] by grad_scale_u[j] where unique position j has a lookup (its
    other entries may be anything, NaN included: never read)."""
    n_lookups = inverse.numel()
    live = torch.zeros(n_lookups, dtype=grad_u.dtype, device=inverse.device).index_add_(
        0, inverse.clamp(min=0), (inverse >= 0).to(grad_u.dtype)) > 0
    k = min(n_lookups, grad_scale_u.numel())
    factor = torch.ones(n_lookups, dtype=grad_u.dtype, device=grad_u.device)
    factor[:k] = grad_scale_u[:k].to(device=grad_u.device, dtype=grad_u.dtype)
    return grad_u * torch.where(live, factor, 1.0).unsqueeze(1)


def bag_backward_torch(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None,
                       grad_scale_u=None):
    """Reference segment reduction: returns grad_u [B, D] (capacity B = lookups) in acc_dtype(grad_out.dtype)."""
    grad_u = _bag_backward_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
    return grad_u if grad_scale_u is None else scale_live_rows(grad_u, inverse, grad_scale_u)


def _bag_backward_torch(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None):
    n_lookups = inverse.numel()
    dim = grad_out.shape[1]
    acc = acc_dtype(grad_out.dtype)
    grad_out = grad_out.to(acc)
    grad_u = torch.zeros(n_lookups, dim, dtype=acc, device=grad_out.device)
    if mode == MODE_MAX:
        if max_pos is None:
            raise ValueError("max mode needs max_pos from the forward")
        if n_lookups == 0:
            return grad_u
        has = max_pos >= 0
        target = inverse[max_pos.clamp(min=0)]
        has &= target >= 0
        flat = (target.clamp(min=0) * dim + torch.arange(dim, device=grad_out.device)).reshape(-1)
        # Out of place, so the reference also runs under vmap (batched gradients: gradcheck, torch.func).
        return grad_u.reshape(-1).index_add(0, flat, torch.where(has, grad_out, 0.0).reshape(-1)).reshape(
            n_lookups, dim)
    bag = bag_of_lookup(offsets, n_lookups)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights, acc)
    contrib = grad_out[bag] * scale.unsqueeze(1)
    return grad_u.index_add(0, inverse.clamp(min=0), contrib)


def unique_grad_torch(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None,
                      grad_scale_u=None):
    """grad_u for the live unique ids only ([n, D] in acc_dtype(grad_out.dtype); n read on the host), each row
    times grad_scale_u[j] when given. Sum/mean reduce each unique id's lookups with torch.embedding_bag over
    grad_out (no [B, D] intermediate); max falls back to the reference."""
    grad_u = _unique_grad_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
    if grad_scale_u is None:
        return grad_u
    n = grad_u.shape[0]
    return grad_u * grad_scale_u[:n].to(device=grad_u.device, dtype=grad_u.dtype).unsqueeze(1)


def _unique_grad_torch(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None):
    if mode == MODE_MAX:
        grad_u = _bag_backward_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
        n = int(inverse.max()) + 1 if inverse.numel() else 0
        return grad_u[:n]
    perm, ptr = lookup_groups(inverse)
    n = int((ptr[1:] > ptr[:-1]).sum())
    n_lookups = inverse.numel()
    bag = bag_of_lookup(offsets, n_lookups)[perm]
    acc = acc_dtype(grad_out.dtype)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights, acc)[perm]
    grad_u, _, _, _ = torch.embedding_bag(grad_out.to(acc).contiguous(), bag, ptr[:n], False, MODE_SUM, False,
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
    return 16 if gpu_shapes(device) else 1


def backward_warps(block_l: int, block_d: int) -> int:
    """Warps for a [block_l, block_d] gradient tile: with four warps, 16 x 128 and 16 x 64 tiles left a few bytes
    of register spill in row-wise and max-mode Adagrad (sm_80/sm_90, triton 3.6 and 3.7); eight do not."""
    if block_l == 1:
        return 1
    tile = block_l * block_d
    return 8 if tile >= 1024 else 4 if tile >= 512 else 1


@triton.jit
def segment_grad(grad_out, perm, bag, scale, max_pos, bos, eos, o_d, m_d, D,
                 MODE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """ACC (fp32, or fp64 for an fp64 grad_out) gradient [BLOCK_D] of one unique id: the sum over its lookups
    perm[bos:eos] (lookup order). BLOCK_L == 1 (CPU) adds in the reference's sequential order; tiles (GPU) are
    tree-reduced and accumulated with Kahan compensation, so a hot id's 10^5 lookups do not lose precision to
    one long running sum."""
    b_g = tl.zeros([BLOCK_D], dtype=ACC)
    b_c = tl.zeros([BLOCK_D], dtype=ACC)
    for k in range(bos, eos, BLOCK_L):
        o_k = k + tl.arange(0, BLOCK_L).to(tl.int64)
        m_k = o_k < eos
        b_i = tl.load(perm + o_k, mask=m_k, other=0)
        b_b = tl.load(bag + b_i, mask=m_k, other=0)
        m_t = m_k[:, None] & m_d[None, :]
        o_t = b_b[:, None] * D + o_d[None, :]
        b_go = tl.load(grad_out + o_t, mask=m_t, other=0.0).to(ACC)
        if MODE == 2:
            # element d of bag b belongs to the lookup the forward picked as its max
            b_mp = tl.load(max_pos + o_t, mask=m_t, other=-1)
            b_go = tl.where(b_mp == b_i[:, None], b_go, 0.0)
        else:
            b_go = b_go * tl.load(scale + b_i, mask=m_k, other=0.0).to(ACC)[:, None]
        if BLOCK_L > 1:
            b_y = tl.sum(b_go, axis=0) - b_c
            b_t = b_g + b_y
            b_c = (b_t - b_g) - b_y
            b_g = b_t
        else:
            b_g += tl.sum(b_go, axis=0)
    return b_g


@triton.jit
def bag_backward_kernel(
    grad_out,  # [n_bags, D]
    perm,  # [B] int64 lookups sorted by unique position
    ptr,  # [B + 1] int64 group starts
    bag,  # [B] int64 bag of each lookup
    scale,  # [B] ACC factor on grad_out[bag] per lookup (sum / mean)
    max_pos,  # [n_bags, D] int64 (max mode)
    gscale,  # [U] factor on each unique id's summed gradient (HAS_GSCALE only)
    grad_u,  # [B, D] ACC
    D,
    MODE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    HAS_GSCALE: tl.constexpr,
):
    i_u, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < D
    bos, eos = tl.load(ptr + i_u), tl.load(ptr + i_u + 1)
    b_g = segment_grad(grad_out, perm, bag, scale, max_pos, bos, eos, o_d, m_d, D, MODE, BLOCK_L, BLOCK_D, ACC)
    if HAS_GSCALE:
        # positions without lookups (past the unique count) keep their 0 and never read their factor
        b_g = b_g * tl.load(gscale + i_u, mask=eos > bos, other=1.0).to(ACC)
    tl.store(grad_u + i_u * D + o_d, b_g, mask=m_d)


def backward_inputs(grad_out, inverse, offsets, mode: int, per_sample_weights, max_pos):
    """What the segment-reduction kernels read besides grad_out: (perm, ptr, bag, scale, max_pos); scale is in
    acc_dtype(grad_out.dtype)."""
    n_lookups = inverse.numel()
    if mode == MODE_MAX and max_pos is None:
        raise ValueError("max mode needs max_pos from the forward")
    perm, ptr = lookup_groups(inverse)
    bag = bag_of_lookup(offsets, n_lookups)
    acc = acc_dtype(grad_out.dtype)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights, acc) if mode != MODE_MAX else inverse
    return perm, ptr, bag, scale, (max_pos if mode == MODE_MAX else grad_out)


def _bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, block_l=None,
                         n_rows=None, grad_scale_u=None):
    n_lookups, dim = inverse.numel(), grad_out.shape[1]
    n_rows = n_lookups if n_rows is None else n_rows
    grad_u = torch.empty(n_rows, dim, dtype=acc_dtype(grad_out.dtype), device=grad_out.device)
    if n_rows == 0 or n_lookups == 0:
        return grad_u.zero_()
    grad_out = grad_out.contiguous()
    perm, ptr, bag, scale, max_pos = backward_inputs(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
    has_gscale = grad_scale_u is not None
    block_l = block_l or backward_block_l(grad_out.device)
    block_d = min(triton.next_power_of_2(dim), 128)
    grid = (n_rows, triton.cdiv(dim, block_d))
    with on_device(grad_out):
        bag_backward_kernel[grid](grad_out, perm, ptr, bag, scale, max_pos.contiguous(),
                                  grad_scale_u.contiguous() if has_gscale else scale, grad_u, dim,
                                  MODE=mode, BLOCK_L=block_l, BLOCK_D=block_d, ACC=tl_acc_dtype(grad_out.dtype),
                                  HAS_GSCALE=has_gscale, num_warps=backward_warps(block_l, block_d))
    return grad_u


def bag_backward_triton(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None,
                        n_rows=None, grad_scale_u=None):
    """Triton path of bag_backward: one program per (unique position, D-block) sums its lookups' gradients
    (grouped by a sort, no atomics) and scales the sum by grad_scale_u[j] when given; positions past the unique
    count have no lookups and get 0. `n_rows` (the unique count, when known) bounds the output to [n_rows, D]
    instead of [lookups, D]."""
    return _bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, n_rows=n_rows,
                                grad_scale_u=grad_scale_u)


def bag_backward(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None, n_rows=None,
                 grad_scale_u=None):
    """grad_u [n_rows or B, D] in acc_dtype(grad_out.dtype) (see module docstring). A grad_out batched by vmap
    (torch.func / gradcheck's batched-gradient check) takes the reference, made of vmap-able torch ops."""
    if backend_for(grad_out.device) == "triton" and not torch._C._functorch.is_batchedtensor(grad_out):
        return bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, n_rows,
                                   grad_scale_u)
    grad_u = bag_backward_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, grad_scale_u)
    return grad_u if n_rows is None else grad_u[:n_rows]


def per_sample_weights_grad_torch(grad_out, rows, loc_u, inverse, offsets, host_rows=None):
    """Reference: d loss / d per_sample_weights (sum mode) = <grad_out[bag], row of the lookup> in
    acc_dtype(rows.dtype); 0 for padding lookups. Gathers a [lookups, D] intermediate (the Triton path does not)."""
    rows, loc_u = with_host_rows(rows, loc_u, host_rows)
    n_lookups = inverse.numel()
    bag = bag_of_lookup(offsets, n_lookups)
    acc = acc_dtype(rows.dtype)
    lookup_rows = rows.index_select(0, lookup_rows_of(loc_u, inverse)).to(acc)
    dots = (grad_out.to(acc)[bag] * lookup_rows).sum(1)
    return torch.where(inverse >= 0, dots, 0.0)


@triton.jit
def psw_grad_kernel(grad_out, rows, host_rows, loc_u, inverse, bag, out, B, D,
                    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """out[i] = <grad_out[bag[i]], row of lookup i> (in ACC) for BLOCK_L lookups; rows at host locations are read
    from the host table. Only [B] floats are written: no [B, D] intermediate."""
    o_l = tl.program_id(0).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L).to(tl.int64)
    m_l = o_l < B
    b_u = tl.load(inverse + o_l, mask=m_l, other=-1)
    m_v = m_l & (b_u >= 0)
    b_r = tl.load(loc_u + tl.maximum(b_u, 0), mask=m_v, other=0).to(tl.int64)
    m_h = m_v & (b_r <= -2)
    m_c = m_v & (b_r > -2)
    b_b = tl.load(bag + o_l, mask=m_v, other=0)
    b_acc = tl.zeros([BLOCK_L], dtype=ACC)
    for i_d in range(0, tl.cdiv(D, BLOCK_D)):
        o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
        m_d = o_d < D
        b_go = tl.load(grad_out + b_b[:, None] * D + o_d[None, :], mask=m_v[:, None] & m_d[None, :], other=0.0)
        b_xc = tl.load(rows + tl.maximum(b_r, 0)[:, None] * D + o_d[None, :], mask=m_c[:, None] & m_d[None, :],
                       other=0.0)
        b_xh = tl.load(host_rows + tl.maximum(-2 - b_r, 0)[:, None] * D + o_d[None, :],
                       mask=m_h[:, None] & m_d[None, :], other=0.0)
        b_x = tl.where(m_h[:, None], b_xh.to(ACC), b_xc.to(ACC))
        b_acc += tl.sum(b_go.to(ACC) * b_x, axis=1)
    tl.store(out + o_l, b_acc, mask=m_l)


def per_sample_weights_grad_triton(grad_out, rows, loc_u, inverse, offsets, host_rows=None):
    n_lookups, dim = inverse.numel(), rows.shape[1]
    out = torch.empty(n_lookups, dtype=acc_dtype(rows.dtype), device=grad_out.device)
    if n_lookups == 0:
        return out
    bag = bag_of_lookup(offsets, n_lookups)
    host = host_rows if host_rows is not None else rows
    # 32 x 32 tiles on the GPU: at 64 x 64 the three fp32 tiles need 255 registers and spill (sm_80/sm_90).
    gpu = gpu_shapes(grad_out.device)
    block_d = min(triton.next_power_of_2(dim), 32 if gpu else 64)
    block_l = 32 if gpu else min(1024, triton.next_power_of_2(n_lookups))
    with on_device(grad_out):
        psw_grad_kernel[(triton.cdiv(n_lookups, block_l),)](
            grad_out.contiguous(), rows.contiguous(), host, loc_u.contiguous(), inverse.contiguous(), bag, out,
            n_lookups, dim, BLOCK_L=block_l, BLOCK_D=block_d, ACC=tl_acc_dtype(rows.dtype), num_warps=4)
    return out


def per_sample_weights_grad(grad_out, rows, loc_u, inverse, offsets, host_rows=None):
    """d loss / d per_sample_weights (sum mode): <grad_out[bag], row of the lookup> in acc_dtype(rows.dtype); 0 for
    padding lookups."""
    if backend_for(grad_out.device) == "triton":
        return per_sample_weights_grad_triton(grad_out, rows, loc_u, inverse, offsets, host_rows)
    return per_sample_weights_grad_torch(grad_out, rows, loc_u, inverse, offsets, host_rows)
