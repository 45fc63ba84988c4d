"""Per-batch unique ids with inverse and counts, into fixed-capacity buffers.

Shapes for a batch of B lookups: `uniq [B]` (the n unique ids ascending, then -1), `inverse [B]` (each lookup's
position in `uniq`; -1 for a padding lookup), `counts [B]` (occurrences; 0 past n), `n_uniq [1]` on the ids'
device. Fixed capacity keeps the GPU path free of host syncs: nothing downstream needs n on the host.
With `return_groups=True` a fifth output, `groups = (perm [B], ptr [B + 1])`, groups the lookups by unique
position as `bag_backward.lookup_groups(inverse)` does (stable; padding lookups last, in no group): both paths
derive it from the sort they did here, so the backward need not sort again.
"""

import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gpu_shapes, on_device
from .host_sort import stable_sort, unique_of_sort

PAD_ID = -1


def unique_ids_torch(ids: torch.Tensor, padding_idx: int | None = None, return_groups: bool = False,
                     sort: tuple[torch.Tensor, torch.Tensor] | None = None, id_bound: int | None = None):
    """Reference: torch.unique, then the padding id (if present) removed from the unique set. With
    `return_groups` the same outputs come from one stable sort of the ids (runs by `unique_consecutive`, the
    inverse scattered back through the sort), and the groups from that sort (`groups_of_sort`), so no second
    sort (of the inverse, as `lookup_groups` does) is needed. `sort`: (sorted ids, permutation) of that stable
    sort, done earlier (the prefetch read-ahead sorts each batch once, when it reads it). `id_bound`: every id
    lies in [-1, id_bound) (a checked table's rows), which spares the sort a min/max pass."""
    n_lookups = ids.numel()
    ids = ids.reshape(-1).to(torch.int64)
    if return_groups:
        if sort is None:
            sort = stable_sort(ids, None if id_bound is None else (-1, max(int(id_bound) - 1, -1)))
        s_ids, s_perm = sort
        uniq, inverse, counts = unique_of_sort(s_ids, s_perm, counts=True)
        uniq = uniq.to(torch.int64)
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


@triton.jit
def _search(p_sorted, B, b_x, RIGHT: tl.constexpr, LOG_B: tl.constexpr):
    """Per lane: the first position of the ascending p_sorted[:B] holding a value >= b_x (> b_x if RIGHT)."""
    b_lo = tl.zeros_like(b_x)
    b_hi = tl.zeros_like(b_x) + B
    for _ in tl.static_range(LOG_B):
        m_go = b_lo < b_hi
        b_mid = (b_lo + b_hi) // 2
        b_v = tl.load(p_sorted + b_mid, mask=m_go, other=0)
        if RIGHT:
            m_right = b_v <= b_x
        else:
            m_right = b_v < b_x
        b_lo = tl.where(m_go & m_right, b_mid + 1, b_lo)
        b_hi = tl.where(m_go & (m_right == 0), b_mid, b_hi)
    return b_lo


@triton.jit
def _heads(s_ids, o_i, m_i, B, padding_idx, HAS_PAD: tl.constexpr):
    b_id = tl.load(s_ids + o_i, mask=m_i, other=0)
    b_prev = tl.load(s_ids + o_i - 1, mask=m_i & (o_i > 0), other=0)
    m_keep = m_i
    if HAS_PAD:
        m_keep = m_keep & (b_id != padding_idx)
    return b_id, m_keep, m_keep & ((o_i == 0) | (b_id != b_prev))


@triton.jit(do_not_specialize=["B", "padding_idx"])
def unique_heads_kernel(s_ids, p_aux, B, padding_idx, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                        SCAN: tl.constexpr):
    """Each block counts its run heads (sorted ids starting a run, padding excluded) into bcount; the last
    block to finish turns the counts into exclusive offsets boff and the total n_uniq.
    p_aux = [done, n_uniq, bcount[n_blocks], boff[n_blocks]] (zeroed)."""
    i_b = tl.program_id(0)
    n_blocks = tl.num_programs(0)
    o_i = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _, _, m_head = _heads(s_ids, o_i, o_i < B, B, padding_idx, HAS_PAD)
    tl.store(p_aux + 2 + i_b, tl.sum(m_head.to(tl.int64), 0))
    if tl.atomic_add(p_aux, 1, sem="acq_rel") == n_blocks - 1:  # the last block: every count is in
        b_carry = tl.zeros([], dtype=tl.int64)
        for j in range(0, n_blocks, SCAN):
            o_j = j + tl.arange(0, SCAN)
            b_c = tl.load(p_aux + 2 + o_j, mask=o_j < n_blocks, other=0)
            tl.store(p_aux + 2 + n_blocks + o_j, b_carry + tl.cumsum(b_c, 0) - b_c, mask=o_j < n_blocks)
            b_carry += tl.sum(b_c, 0)
        tl.store(p_aux + 1, b_carry)


@triton.jit(do_not_specialize=["B", "padding_idx"])
def unique_scatter_kernel(s_ids, s_perm, p_aux, o_uniq, o_inverse, o_counts, o_perm, o_ptr, B, padding_idx,
                          HAS_PAD: tl.constexpr, LOG_B: tl.constexpr, BLOCK: tl.constexpr):
    """Sorted id i belongs to unique position u = boff[block] + (heads up to i in the block) - 1. Heads write the
    id and their group start, tails the run length (the run's start found by binary search); every lookup
    writes its inverse and its place in `perm` (the sorted lookups with the padding run moved to the end).
    Positions past n_uniq get uniq -1, count 0, group start = the non-padding lookups."""
    i_b = tl.program_id(0)
    o_i = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    n_uniq = tl.load(p_aux + 1)
    b_id, m_keep, m_head = _heads(s_ids, o_i, m_i, B, padding_idx, HAS_PAD)
    b_next = tl.load(s_ids + o_i + 1, mask=m_i & (o_i + 1 < B), other=0)
    m_tail = m_keep & ((o_i + 1 == B) | (b_id != b_next))
    b_u = tl.load(p_aux + 2 + tl.num_programs(0) + i_b) + tl.cumsum(m_head.to(tl.int64), 0) - 1
    p0 = tl.zeros([BLOCK], dtype=tl.int64)
    n_pad = tl.zeros([BLOCK], dtype=tl.int64)
    if HAS_PAD:
        b_pad = tl.zeros([BLOCK], dtype=tl.int64) + padding_idx
        p0 = _search(s_ids, B, b_pad, False, LOG_B)
        n_pad = _search(s_ids, B, b_pad, True, LOG_B) - p0
    b_c = tl.where(m_keep, tl.where(o_i < p0, o_i, o_i - n_pad), B - n_pad + (o_i - p0))
    tl.store(o_uniq + b_u, b_id, mask=m_head)
    tl.store(o_ptr + b_u, b_c, mask=m_head)
    b_start = _search(s_ids, B, b_id, False, LOG_B)
    tl.store(o_counts + b_u, o_i + 1 - b_start, mask=m_tail)
    b_lookup = tl.load(s_perm + o_i, mask=m_i, other=0)
    tl.store(o_inverse + b_lookup, tl.where(m_keep, b_u, -1), mask=m_i)
    tl.store(o_perm + b_c, b_lookup, mask=m_i)
    m_past = m_i & (o_i >= n_uniq)
    tl.store(o_uniq + o_i, tl.zeros_like(o_i) - 1, mask=m_past)
    tl.store(o_counts + o_i, tl.zeros_like(o_i), mask=m_past)
    tl.store(o_ptr + o_i, B - n_pad, mask=m_past)
    tl.store(o_ptr + o_i + 1, B - n_pad, mask=o_i == B - 1)


def unique_ids_triton(ids: torch.Tensor, padding_idx: int | None = None, return_groups: bool = False,
                      buffers=None):
    """Sort (stable), then two launches: run heads counted per block (the last block turns the counts into
    offsets), then every output scattered. Same outputs as `unique_ids_torch`, no host sync. `buffers`
    (out [5B + 1] int64, aux [2 + 2 x blocks] int64 zeroed; `unique_buffers` sizes them) spares the two
    allocations."""
    ids = ids.reshape(-1).to(torch.int64)
    B = ids.numel()
    dev = ids.device
    if B == 0:
        uniq = torch.full((0,), PAD_ID, dtype=torch.int64, device=dev)
        n_uniq = torch.zeros(1, dtype=torch.int64, device=dev)
        groups = (uniq, torch.zeros(1, dtype=torch.int64, device=dev))
        return (uniq, uniq, uniq, n_uniq, groups) if return_groups else (uniq, uniq, uniq, n_uniq)
    block = unique_block(B, dev)
    n_blocks = triton.cdiv(B, block)
    out, aux = buffers if buffers is not None else (torch.empty(5 * B + 1, dtype=torch.int64, device=dev),
                                                     torch.zeros(2 + 2 * n_blocks, dtype=torch.int64, device=dev))
    uniq, inverse, counts, perm, ptr = out[:B], out[B:2 * B], out[2 * B:3 * B], out[3 * B:4 * B], out[4 * B:]
    s_ids, s_perm = torch.sort(ids, stable=True)
    has_pad = padding_idx is not None
    pad = int(padding_idx) if has_pad else 0
    # 8 warps from 512 lanes: with 4, unique_scatter_kernel spilled at BLOCK=512 on sm_80
    warps = 8 if block >= 512 else 4
    unique_heads_kernel[(n_blocks,)](s_ids, aux, B, pad, HAS_PAD=has_pad, BLOCK=block,
                                     SCAN=max(16, min(1024, triton.next_power_of_2(n_blocks))), num_warps=warps)
    unique_scatter_kernel[(n_blocks,)](s_ids, s_perm, aux, uniq, inverse, counts, perm, ptr, B, pad,
                                       HAS_PAD=has_pad, LOG_B=max(1, B.bit_length()), BLOCK=block, num_warps=warps)
    n_uniq = aux[1:2]
    if not return_groups:
        return uniq, inverse, counts, n_uniq
    return uniq, inverse, counts, n_uniq, (perm, ptr)


def unique_block(B: int, device) -> int:
    # >= 16 lanes: Triton's interpreter before 3.3 ignores the mask of a one-element store
    return min(1024 if gpu_shapes(device) else 4096, max(16, triton.next_power_of_2(B)))


def unique_buffers(B: int, device):
    """Sizes of unique_ids_triton's `buffers`: (out elements, aux elements)."""
    return 5 * B + 1, 2 + 2 * triton.cdiv(B, unique_block(B, device))


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


def unique_ids(ids: torch.Tensor, padding_idx: int | None = None, return_groups: bool = False, buffers=None,
               id_bound: int | None = None):
    if backend_for(ids.device) == "triton":
        with on_device(ids):
            return unique_ids_triton(ids, padding_idx, return_groups, buffers)
    return unique_ids_torch(ids, padding_idx, return_groups, id_bound=id_bound)
