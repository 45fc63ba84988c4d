"""Gradient of the pooled forward, reduced per unique id (duplicates summed once per row).

`grad_u [U, D]` fp32 (fp64 for an fp64 grad_out, `acc_dtype`): row j holds the summed gradient of unique id j
over all its lookups; rows past n are 0. sum: each lookup gets grad_out[bag] * per_sample_weight; mean:
grad_out[bag] / (non-padding lookups in bag); max: element d of bag b goes to the lookup at max_pos[b, d] only.
Padding lookups get nothing. `grad_scale_u [U]` (optional, e.g. 1 / count for `scale_grad_by_freq`) multiplies
row j's sum by grad_scale_u[j]; entries past the unique count are never read.
"""

import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gpu_shapes, on_device, persistent_programs
from .host_sort import stable_sort
from .pooled_forward import (MODE_MAX, MODE_MEAN, MODE_SUM, acc_dtype, ieee_div, lookup_rows_of, tl_acc_dtype,
                             with_host_rows)


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
                      grad_scale_u=None, groups=None):
    """grad_u for the live unique ids only ([n, D] in acc_dtype(grad_out.dtype); n read on the host), each row
    times grad_scale_u[j] when given. Sum/mean reduce each unique id's lookups with torch.embedding_bag over
    grad_out (no [B, D] intermediate), grouped by `groups` (perm, ptr) from unique_ids' sort, else by
    `lookup_groups`; max falls back to the reference."""
    grad_u = _unique_grad_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, groups)
    if grad_scale_u is None:
        return grad_u
    n = grad_u.shape[0]
    return grad_u * grad_scale_u[:n].to(device=grad_u.device, dtype=grad_u.dtype).unsqueeze(1)


def _unique_grad_torch(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None, groups=None):
    if mode == MODE_MAX:
        grad_u = _bag_backward_torch(grad_out, inverse, offsets, mode, per_sample_weights, max_pos)
        n = int(inverse.max()) + 1 if inverse.numel() else 0
        return grad_u[:n]
    perm, ptr = groups if groups is not None else lookup_groups(inverse)
    n = int((ptr[1:] > ptr[:-1]).sum())
    if n == 0:  # every lookup is padding: embedding_bag with no offsets but lookups writes out of bounds
        return grad_out.new_zeros(0, grad_out.shape[1], dtype=acc_dtype(grad_out.dtype))
    n_lookups = inverse.numel()
    bag = bag_of_lookup(offsets, n_lookups).index_select(0, perm)
    acc = acc_dtype(grad_out.dtype)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights, acc).index_select(0, perm)
    grad_u, _, _, _ = torch.embedding_bag(grad_out.to(acc).contiguous(), bag, ptr[:n], False, MODE_SUM, False,
                                          scale, False, None)
    return grad_u


def lookup_groups(inverse: torch.Tensor):
    """Lookups grouped by unique position, without a host sync: `perm [B]` (a stable sort, so lookup order
    within a group) and `ptr [B + 1]` (group j is perm[ptr[j]:ptr[j+1]]); padding lookups fall in no group.
    `unique_ids(..., return_groups=True)` gives the same pair from the sort it already did."""
    n_lookups = inverse.numel()
    key = torch.where(inverse >= 0, inverse, torch.full_like(inverse, n_lookups))
    _, perm = stable_sort(key, (0, n_lookups))
    # Group sizes by an integer scatter-add (exact in any order), starts by their cumsum: what a searchsorted of
    # the sorted keys gives, at O(B) instead of O(B log B).
    sizes = torch.zeros(n_lookups + 1, dtype=torch.int64, device=inverse.device).index_add_(
        0, key, torch.ones_like(key))
    ptr = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes[:n_lookups], 0)])
    return perm, ptr


def backward_block_l(device: torch.device) -> int:
    """Lookups reduced per step: 1 keeps the reference's sequential fp32 order (CPU, where the reference is
    sequential too); on the GPU the reference sums in atomic order anyway, so reduce in tiles for bandwidth."""
    return 16 if gpu_shapes(device) else 1


def backward_chunk(device: torch.device) -> int | None:
    """Lookups one program reduces at most for one id; a longer segment (a hot id: 10^5 lookups in a batch) is
    split into chunks reduced by separate programs into partial sums, added in chunk order (as FBGEMM splits
    long segments). None on CPU: no split keeps the reference's sequential fp32 order."""
    return 512 if gpu_shapes(device) else None


def backward_warps(block_l: int, block_d: int) -> int:
    """Warps for a [block_l, block_d] gradient tile: with four warps, 16 x 128 and 16 x 64 tiles left a few bytes
    of register spill in row-wise and max-mode Adagrad (sm_80/sm_90, triton 3.6 and 3.7); eight do not."""
    if block_l == 1:
        return 1
    tile = block_l * block_d
    return 8 if tile >= 1024 else 4 if tile >= 512 else 1


def backward_launch(block_l: int, block_d: int, fp64: bool = False) -> dict:
    """Launch options of the backward kernels: backward_warps, and for tiles (GPU) a 64-register cap: left to
    itself ptxas held the persistent loops at 40 registers and spilled loop invariants (sm_80 / sm_90); capped,
    it uses up to 64 without spilling, and 4 programs of 8 warps still fit an SM (persistent_programs). The
    16 x 128 tiles of bag_backward (no update) need 128, and so do fp64 tiles (a value takes two registers:
    Triton 3.9's ptxas spilled 4 bytes of the scaled max-mode row-wise Adagrad update at 64 on sm_90; it uses 72)."""
    options = {"num_warps": backward_warps(block_l, block_d)}
    if block_l > 1:
        options["maxnreg"] = 64 if block_l * block_d <= 1024 and not fp64 else 128
    return options


@triton.jit
def kahan_add(b_g, b_c, b_x, BLOCK_L: tl.constexpr):
    """(sum, compensation) after adding the [BLOCK_L, BLOCK_D] tile b_x: BLOCK_L == 1 adds in sequential order
    (the reference's); tiles are tree-reduced and accumulated with Kahan compensation, so a hot id's many
    lookups do not lose precision to one long running sum."""
    if BLOCK_L > 1:
        b_y = tl.sum(b_x, axis=0) - b_c
        b_t = b_g + b_y
        b_c = (b_t - b_g) - b_y
        b_g = b_t
    else:
        b_g += tl.sum(b_x, axis=0)
    return b_g, b_c


# How the segment kernels weigh a lookup's grad_out[bag] (sum / mean): SCALE_GIVEN reads `scale [B]` (lookup_scale);
# the others need no [B] buffer: SCALE_ONE (sum), SCALE_PSW (`scale` = the per-sample weights), SCALE_BAG (mean:
# `scale` = each bag's non-padding lookups, clamped to >= 1, as the forward counted them). Lookups in a group are
# never padding, so these equal lookup_scale's factors bit for bit.
SCALE_GIVEN, SCALE_ONE, SCALE_PSW, SCALE_BAG = range(4)


@triton.jit
def segment_grad(grad_out, perm, bag, scale, max_pos, bos, eos, o_d, m_d, D, lead,
                 MODE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                 SCALE: tl.constexpr):
    """ACC (fp32, or fp64 for an fp64 grad_out) gradient [BLOCK_D] of lookups perm[bos:eos] (one id's, lookup
    order), accumulated by kahan_add. Bag b's gradient is grad_out row b - lead (phantom bags before the
    caller's hold only padding lookups, never in a group)."""
    b_g = tl.zeros([BLOCK_D], dtype=ACC)
    b_c = tl.zeros([BLOCK_D], dtype=ACC)
    for k in range(bos, eos, BLOCK_L):
        o_k = k + tl.arange(0, BLOCK_L).to(tl.int64)
        m_k = o_k < eos
        b_i = tl.load(perm + o_k, mask=m_k, other=0)
        b_b = tl.load(bag + b_i, mask=m_k, other=0)
        m_t = m_k[:, None] & m_d[None, :]
        o_t = b_b[:, None] * D + o_d[None, :]
        b_go = tl.load(grad_out + (b_b - lead)[:, None] * D + o_d[None, :], mask=m_t, other=0.0).to(ACC)
        if MODE == 2:
            # element d of bag b belongs to the lookup the forward picked as its max
            b_mp = tl.load(max_pos + o_t, mask=m_t, other=-1)
            b_go = tl.where(b_mp == b_i[:, None], b_go, 0.0)
        elif SCALE == 0 or SCALE == 2:
            b_go = b_go * tl.load(scale + b_i, mask=m_k, other=0.0).to(ACC)[:, None]
        elif SCALE == 3:
            b_n = tl.load(scale + b_b, mask=m_k, other=1.0).to(ACC)
            b_go = b_go * ieee_div(tl.full([BLOCK_L], 1.0, ACC), b_n)[:, None]
        b_g, b_c = kahan_add(b_g, b_c, b_go, BLOCK_L)
    return b_g


@triton.jit
def unique_grad(grad_out, perm, ptr, cptr, partial, bag, scale, max_pos, i_u, o_d, m_d, D, lead,
                MODE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                CHUNKED: tl.constexpr, SCALE: tl.constexpr):
    """Gradient [BLOCK_D] of unique position i_u: its lookups reduced here, or (CHUNKED, a long segment) the
    partial sums of its chunks partial[cptr[i_u]:cptr[i_u+1]] added in chunk order: a fixed order, so the
    result is the same bits on every run."""
    bos, eos = tl.load(ptr + i_u), tl.load(ptr + i_u + 1)
    if CHUNKED:
        c0, c1 = tl.load(cptr + i_u), tl.load(cptr + i_u + 1)
        if c1 > c0:
            b_g = tl.zeros([BLOCK_D], dtype=ACC)
            b_c = tl.zeros([BLOCK_D], dtype=ACC)
            for k in range(c0, c1, BLOCK_L):
                o_k = k + tl.arange(0, BLOCK_L).to(tl.int64)
                m_t = (o_k < c1)[:, None] & m_d[None, :]
                b_p = tl.load(partial + o_k[:, None] * D + o_d[None, :], mask=m_t, other=0.0)
                b_g, b_c = kahan_add(b_g, b_c, b_p, BLOCK_L)
        else:
            b_g = segment_grad(grad_out, perm, bag, scale, max_pos, bos, eos, o_d, m_d, D, lead, MODE, BLOCK_L,
                               BLOCK_D, ACC, SCALE)
    else:
        b_g = segment_grad(grad_out, perm, bag, scale, max_pos, bos, eos, o_d, m_d, D, lead, MODE, BLOCK_L, BLOCK_D,
                           ACC, SCALE)
    return b_g


@triton.jit
def segment_partials_kernel(
    grad_out,  # [n_bags, D]
    perm,  # [B] int64 lookups sorted by unique position
    ptr,  # [B + 1] int64 group starts
    cptr,  # [G + 1] int64 chunk starts of each group (equal for an unsplit group); cptr[G]: the chunk count
    chunk_seg,  # [K] int64 group of each chunk
    bag,  # [B] int64 bag of each lookup
    scale,  # [B] ACC (sum / mean)
    max_pos,  # [n_bags, D] int64 (max)
    partial,  # [K, D] ACC out: each chunk's sum
    G,  # groups (unique positions)
    D,
    lead,  # grad_out row of bag b: b - lead
    CHUNK: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    SCALE: tl.constexpr,
):
    """Phase 1 of a split segment: chunk k of group j = chunk_seg[k] is lookups CHUNK * (k - cptr[j]) onwards
    of the group; persistent programs loop over the chunks up to the device-side count cptr[G]."""
    i_p, i_d = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < D
    k = i_p.to(tl.int64)
    while k < tl.load(cptr + G):  # re-read per round: a bound held across the body spilled (sm_80)
        j = tl.load(chunk_seg + k)
        bos = tl.load(ptr + j) + (k - tl.load(cptr + j)) * CHUNK
        eos = tl.minimum(bos + CHUNK, tl.load(ptr + j + 1))
        b_g = segment_grad(grad_out, perm, bag, scale, max_pos, bos, eos, o_d, m_d, D, lead, MODE, BLOCK_L, BLOCK_D,
                           ACC, SCALE)
        tl.store(partial + k * D + o_d, b_g, mask=m_d)
        k += tl.num_programs(0)


def segment_chunks(ptr: torch.Tensor, n_lookups: int, chunk: int):
    """The split of long groups (more than `chunk` lookups) of `ptr [G + 1]` over n_lookups lookups, on the
    device: `cptr [G + 1]` (group j's chunks are cptr[j]:cptr[j+1], none for a short group; cptr[G] counts them)
    and `chunk_seg [K]` (each chunk's group; K = 2 * n_lookups // chunk bounds the count statically, as a long
    group has < 2 * len / chunk chunks)."""
    lengths = ptr[1:] - ptr[:-1]
    n_chunks = torch.where(lengths > chunk, (lengths + chunk - 1) // chunk, 0)
    cptr = torch.cat([n_chunks.new_zeros(1), torch.cumsum(n_chunks, 0)])
    bound = 2 * n_lookups // chunk
    chunk_seg = torch.searchsorted(cptr, torch.arange(bound, device=ptr.device), right=True) - 1
    return cptr, chunk_seg


def chunk_partials(grad_out, perm, ptr, bag, scale, max_pos, mode, chunk, block_l, block_d, lead: int = 0,
                   scale_kind: int = SCALE_GIVEN):
    """Phase 1 (see segment_partials_kernel): (cptr, partial [K, D]) for unique_grad, or None when no group can
    be long (chunk None, or fewer than `chunk` lookups in all)."""
    n_lookups, dim = perm.numel(), grad_out.shape[1]
    if chunk is None or 2 * n_lookups // chunk == 0:
        return None
    cptr, chunk_seg = segment_chunks(ptr, n_lookups, chunk)
    partial = torch.empty(chunk_seg.numel(), dim, dtype=acc_dtype(grad_out.dtype), device=grad_out.device)
    grid = (persistent_programs(grad_out.device, chunk_seg.numel()), triton.cdiv(dim, block_d))
    with on_device(grad_out):
        segment_partials_kernel[grid](grad_out, perm, ptr, cptr, chunk_seg, bag, scale, max_pos, partial,
                                      ptr.numel() - 1, dim, lead, CHUNK=chunk, MODE=mode,
                                      BLOCK_L=block_l, BLOCK_D=block_d, ACC=tl_acc_dtype(grad_out.dtype),
                                      SCALE=scale_kind,
                                      **backward_launch(block_l, block_d, grad_out.dtype == torch.float64))
    return cptr, partial


@triton.jit
def bag_backward_kernel(
    grad_out,  # [n_bags, D]
    perm,  # [B] int64 lookups sorted by unique position
    ptr,  # [B + 1] int64 group starts
    cptr,  # [B + 1] int64 chunk starts of each group (CHUNKED only)
    partial,  # [K, D] ACC partial sums of the chunks (CHUNKED only)
    bag,  # [B] int64 bag of each lookup
    scale,  # [B] ACC factor on grad_out[bag] per lookup (sum / mean)
    max_pos,  # [n_bags, D] int64 (max mode)
    gscale,  # [U] factor on each unique id's summed gradient (HAS_GSCALE only)
    grad_u,  # [n_rows, D] ACC
    n_rows,
    D,
    MODE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    HAS_GSCALE: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    """Persistent programs over the unique positions: every output row is written (0 past the unique count)."""
    i_p, i_d = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < D
    for i in range(i_p, n_rows, tl.num_programs(0)):
        i_u = tl.cast(i, tl.int64)
        b_g = unique_grad(grad_out, perm, ptr, cptr, partial, bag, scale, max_pos, i_u, o_d, m_d, D, 0, MODE,
                          BLOCK_L, BLOCK_D, ACC, CHUNKED, 0)
        if HAS_GSCALE:
            # positions without lookups (past the unique count) keep their 0 and never read their factor
            live = tl.load(ptr + i_u + 1) > tl.load(ptr + i_u)
            b_g = b_g * tl.load(gscale + i_u, mask=live, other=1.0).to(ACC)
        tl.store(grad_u + i_u * D + o_d, b_g, mask=m_d)


def backward_inputs(grad_out, inverse, offsets, mode: int, per_sample_weights, max_pos, groups=None):
    """What the segment-reduction kernels read besides grad_out: (perm, ptr, bag, scale, max_pos); scale is in
    acc_dtype(grad_out.dtype). `groups` (perm, ptr) from unique_ids' sort, else sorted here."""
    n_lookups = inverse.numel()
    if mode == MODE_MAX and max_pos is None:
        raise ValueError("max mode needs max_pos from the forward")
    perm, ptr = groups if groups is not None else lookup_groups(inverse)
    bag = bag_of_lookup(offsets, n_lookups)
    acc = acc_dtype(grad_out.dtype)
    scale = lookup_scale(inverse, offsets, mode, per_sample_weights, acc) if mode != MODE_MAX else inverse
    return perm, ptr, bag, scale, (max_pos if mode == MODE_MAX else grad_out)


def _bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, block_l=None,
                         n_rows=None, grad_scale_u=None, groups=None, chunk="auto"):
    n_lookups, dim = inverse.numel(), grad_out.shape[1]
    n_rows = n_lookups if n_rows is None else n_rows
    grad_u = torch.empty(n_rows, dim, dtype=acc_dtype(grad_out.dtype), device=grad_out.device)
    if n_rows == 0 or n_lookups == 0:
        return grad_u.zero_()
    grad_out = grad_out.contiguous()
    perm, ptr, bag, scale, max_pos = backward_inputs(grad_out, inverse, offsets, mode, per_sample_weights, max_pos,
                                                     groups)
    max_pos = max_pos.contiguous()
    has_gscale = grad_scale_u is not None
    block_l = block_l or backward_block_l(grad_out.device)
    block_d = min(triton.next_power_of_2(dim), 128)
    chunk = backward_chunk(grad_out.device) if chunk == "auto" else chunk
    split = chunk_partials(grad_out, perm, ptr, bag, scale, max_pos, mode, chunk, block_l, block_d)
    cptr, partial = split if split is not None else (ptr, grad_u)
    grid = (persistent_programs(grad_out.device, n_rows), triton.cdiv(dim, block_d))
    with on_device(grad_out):
        bag_backward_kernel[grid](grad_out, perm, ptr, cptr, partial, bag, scale, max_pos,
                                  grad_scale_u.contiguous() if has_gscale else scale, grad_u, n_rows, dim,
                                  MODE=mode, BLOCK_L=block_l, BLOCK_D=block_d, ACC=tl_acc_dtype(grad_out.dtype),
                                  HAS_GSCALE=has_gscale, CHUNKED=split is not None,
                                  **backward_launch(block_l, block_d, grad_out.dtype == torch.float64))
    return grad_u


def bag_backward_triton(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None,
                        n_rows=None, grad_scale_u=None, groups=None):
    """Triton path of bag_backward: persistent programs (a grid sized by the machine) loop over the unique
    positions; each sums its lookups' gradients (grouped by a sort, no atomics; a hot id's long group in
    chunks, see segment_partials_kernel) and scales the sum by grad_scale_u[j] when given; positions past the
    unique count have no lookups and get 0. `n_rows` (the unique count, when known) bounds the output to
    [n_rows, D] instead of [lookups, D]; `groups` (perm, ptr) reuses unique_ids' sort."""
    return _bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, n_rows=n_rows,
                                grad_scale_u=grad_scale_u, groups=groups)


def bag_backward(grad_out, inverse, offsets, mode: int, per_sample_weights=None, max_pos=None, n_rows=None,
                 grad_scale_u=None, groups=None):
    """grad_u [n_rows or B, D] in acc_dtype(grad_out.dtype) (see module docstring). A grad_out batched by vmap
    (torch.func / gradcheck's batched-gradient check) takes the reference, made of vmap-able torch ops."""
    if backend_for(grad_out.device) == "triton" and not torch._C._functorch.is_batchedtensor(grad_out):
        return bag_backward_triton(grad_out, inverse, offsets, mode, per_sample_weights, max_pos, n_rows,
                                   grad_scale_u, groups)
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
