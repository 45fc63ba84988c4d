"""Per-batch unique ids with inverse and counts, into fixed-capacity buffers.

Shapes for a batch of B lookups: `uniq [B]` (the n unique ids ascending, then -1), `inverse [B]` (each lookup's
position in `uniq`; -1 for a padding lookup), `counts [B]` (occurrences; 0 past n), `n_uniq [1]` on the ids'
device. Fixed capacity keeps the GPU path free of host syncs: nothing downstream needs n on the host.
With `return_groups=True` a fifth output, `groups = (perm [B], ptr [B + 1])`, groups the lookups by unique
position as `bag_backward.lookup_groups(inverse)` does (stable; padding lookups last, in no group): both paths
derive it from the sort they did here, so the backward need not sort again.
"""

import torch
import triton
import triton.language as tl

from .dispatch import backend_for, gpu_shapes, on_device

PAD_ID = -1


def unique_ids_torch(ids: torch.Tensor, padding_idx: int | None = None, return_groups: bool = False):
    """Reference: torch.unique, then the padding id (if present) removed from the unique set. With
    `return_groups` the same outputs come from one stable sort of the ids (runs by `unique_consecutive`, the
    inverse scattered back through the sort), and the groups from that sort (`groups_of_sort`), so no second
    sort (of the inverse, as `lookup_groups` does) is needed."""
    n_lookups = ids.numel()
    ids = ids.reshape(-1).to(torch.int64)
    if return_groups:
        s_ids, s_perm = torch.sort(ids, stable=True)
        uniq, s_inverse, counts = torch.unique_consecutive(s_ids, return_inverse=True, return_counts=True)
        inverse = torch.empty_like(s_inverse).scatter_(0, s_perm, s_inverse)
    else:
        uniq, inverse, counts = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
    if padding_idx is not None:
        keep = uniq != padding_idx
        new_pos = torch.cumsum(keep, 0) - 1
        inverse = torch.where(keep[inverse], new_pos[inverse], torch.full_like(inverse, PAD_ID))
        uniq, counts = uniq[keep], counts[keep]
    n = uniq.numel()
    uniq_buf = torch.full((n_lookups,), PAD_ID, dtype=torch.int64, device=ids.device)
    count_buf = torch.zeros(n_lookups, dtype=torch.int64, device=ids.device)
    uniq_buf[:n] = uniq
    count_buf[:n] = counts
    n_uniq = torch.tensor([n], dtype=torch.int64, device=ids.device)
    inverse = inverse.reshape(-1)
    if return_groups:
        return uniq_buf, inverse, count_buf, n_uniq, groups_of_sort(s_ids, s_perm, count_buf, padding_idx)
    return uniq_buf, inverse, count_buf, n_uniq


@triton.jit(do_not_specialize=["B", "padding_idx"])
def unique_heads_kernel(s_ids, o_head, B, padding_idx, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """o_head[i] = 1 where sorted id i starts a run of equal ids (and is not the padding id), else 0."""
    i_b = tl.program_id(0)
    o_i = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    b_id = tl.load(s_ids + o_i, mask=m_i, other=0)
    b_prev = tl.load(s_ids + o_i - 1, mask=m_i & (o_i > 0), other=0)
    b_head = (o_i == 0) | (b_id != b_prev)
    if HAS_PAD:
        b_head = b_head & (b_id != padding_idx)
    tl.store(o_head + o_i, b_head.to(tl.int64), mask=m_i)


@triton.jit(do_not_specialize=["B", "padding_idx"])
def unique_scatter_kernel(s_ids, s_perm, p_pos, o_uniq, o_inverse, o_counts, B, padding_idx,
                          HAS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Sorted id i belongs to unique position p_pos[i] - 1 (inclusive cumsum of heads). Heads write the id; run
    boundaries add -start / +end into counts (zeroed) so the count needs no second pass; every lookup writes its
    inverse through the sort permutation."""
    i_b = tl.program_id(0)
    o_i = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    b_id = tl.load(s_ids + o_i, mask=m_i, other=0)
    b_prev = tl.load(s_ids + o_i - 1, mask=m_i & (o_i > 0), other=0)
    b_next = tl.load(s_ids + o_i + 1, mask=m_i & (o_i + 1 < B), other=0)
    b_u = tl.load(p_pos + o_i, mask=m_i, other=0) - 1
    b_lookup = tl.load(s_perm + o_i, mask=m_i, other=0)
    b_keep = m_i
    if HAS_PAD:
        b_keep = b_keep & (b_id != padding_idx)
    m_head = b_keep & ((o_i == 0) | (b_id != b_prev))
    m_tail = b_keep & ((o_i + 1 == B) | (b_id != b_next))
    tl.store(o_uniq + b_u, b_id, mask=m_head)
    tl.atomic_add(o_counts + b_u, -o_i, mask=m_head, sem="relaxed")
    tl.atomic_add(o_counts + b_u, o_i + 1, mask=m_tail, sem="relaxed")
    tl.store(o_inverse + b_lookup, tl.where(b_keep, b_u, -1), mask=m_i)


def unique_ids_triton(ids: torch.Tensor, padding_idx: int | None = None, return_groups: bool = False):
    """Sort (stable), flag run heads, number them with a cumsum, scatter. Same outputs as `unique_ids_torch`, no
    host sync."""
    ids = ids.reshape(-1).to(torch.int64)
    B = ids.numel()
    dev = ids.device
    uniq = torch.full((B,), PAD_ID, dtype=torch.int64, device=dev)
    counts = torch.zeros(B, dtype=torch.int64, device=dev)
    inverse = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        n_uniq = torch.zeros(1, dtype=torch.int64, device=dev)
        groups = (inverse, torch.zeros(1, dtype=torch.int64, device=dev))
        return (uniq, inverse, counts, n_uniq, groups) if return_groups else (uniq, inverse, counts, n_uniq)
    s_ids, s_perm = torch.sort(ids, stable=True)
    head = torch.empty(B, dtype=torch.int64, device=dev)
    has_pad = padding_idx is not None
    pad = int(padding_idx) if has_pad else 0
    # >= 16 lanes: Triton's interpreter before 3.3 ignores the mask of a one-element store
    BLOCK = min(1024 if gpu_shapes(dev) else 4096, max(16, triton.next_power_of_2(B)))
    grid = (triton.cdiv(B, BLOCK),)
    # 8 warps from 512 lanes: with 4, unique_scatter_kernel spilled at BLOCK=512 on sm_80
    warps = 8 if BLOCK >= 512 else 4
    unique_heads_kernel[grid](s_ids, head, B, pad, HAS_PAD=has_pad, BLOCK=BLOCK, num_warps=warps)
    pos = torch.cumsum(head, 0)
    unique_scatter_kernel[grid](s_ids, s_perm, pos, uniq, inverse, counts, B, pad, HAS_PAD=has_pad, BLOCK=BLOCK,
                                num_warps=warps)
    if not return_groups:
        return uniq, inverse, counts, pos[B - 1:]
    return uniq, inverse, counts, pos[B - 1:], groups_of_sort(s_ids, s_perm, counts, padding_idx)


def groups_of_sort(s_ids, s_perm, counts, padding_idx: int | None = None):
    """`lookup_groups(inverse)` from the stable sort of the ids: the sorted lookups with the padding id's run
    moved to the end (a gather, no sort), and group starts from the counts."""
    B = s_ids.numel()
    perm = s_perm
    if padding_idx is not None:
        pad = torch.tensor([padding_idx], dtype=s_ids.dtype, device=s_ids.device)
        p0 = torch.searchsorted(s_ids, pad)
        n_pad = torch.searchsorted(s_ids, pad, right=True) - p0
        q = torch.arange(B, device=s_ids.device)
        src = torch.where(q < p0, q, torch.where(q < B - n_pad, q + n_pad, q - (B - n_pad) + p0))
        perm = s_perm[src]
    ptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    return perm, ptr


def unique_ids(ids: torch.Tensor, padding_idx: int | None = None, return_groups: bool = False):
    if backend_for(ids.device) == "triton":
        with on_device(ids):
            return unique_ids_triton(ids, padding_idx, return_groups)
    return unique_ids_torch(ids, padding_idx, return_groups)
