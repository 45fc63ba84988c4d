"""id -> cache slot lookup over a sorted index of the resident ids.

The index is two [C] tensors: `keys` (resident ids ascending, empty slots as INT64_MAX at the end) and `slots`
(the slot holding each key). Device memory is O(cache rows), not O(table rows); a lookup is a binary search.
"""

import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gpu_shapes, on_device

EMPTY_KEY = torch.iinfo(torch.int64).max


def slot_lookup_torch(keys: torch.Tensor, slots: torch.Tensor, query: torch.Tensor, n_query: torch.Tensor):
    """Slot of each of the first n_query ids of `query` [B]; -1 for a miss, a negative id, or a position >= n."""
    capacity = keys.numel()
    if capacity == 0:
        return torch.full_like(query, -1)
    pos = torch.searchsorted(keys, query).clamp_(max=capacity - 1)
    valid = torch.arange(query.numel(), device=query.device) < n_query
    hit = (keys[pos] == query) & valid & (query >= 0)
    return torch.where(hit, slots[pos], torch.full_like(query, -1))


@triton.jit(do_not_specialize=["B"])
def slot_lookup_kernel(p_keys, p_slots, p_query, n_ptr, o_slot, B, C, N_ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """Lower-bound binary search of each query in keys [C]; N_ITERS = ceil(log2(C + 1)) halvings always suffice."""
    i_b = tl.program_id(0)
    o_i = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_i = o_i < B
    n = tl.load(n_ptr)
    b_q = tl.load(p_query + o_i, mask=m_i, other=-1)
    b_lo = tl.zeros([BLOCK], dtype=tl.int64)
    b_hi = tl.zeros([BLOCK], dtype=tl.int64) + C
    for _ in tl.static_range(N_ITERS):
        m_open = b_lo < b_hi
        b_mid = (b_lo + b_hi) // 2
        b_key = tl.load(p_keys + b_mid, mask=m_i & m_open, other=0)
        m_right = m_open & (b_key < b_q)
        b_lo = tl.where(m_right, b_mid + 1, b_lo)
        b_hi = tl.where(m_open & (b_key >= b_q), b_mid, b_hi)  # not ~m_right: no ~ on masks before triton 3.4
    b_pos = tl.minimum(b_lo, C - 1)
    b_key = tl.load(p_keys + b_pos, mask=m_i, other=0)
    m_hit = m_i & (o_i < n) & (b_q >= 0) & (b_key == b_q)
    b_slot = tl.load(p_slots + b_pos, mask=m_hit, other=-1)
    tl.store(o_slot + o_i, tl.where(m_hit, b_slot, -1), mask=m_i)


def slot_lookup_triton(keys: torch.Tensor, slots: torch.Tensor, query: torch.Tensor, n_query: torch.Tensor):
    """Same outputs as `slot_lookup_torch`; n_query stays on the device (an int is also accepted)."""
    capacity, B = keys.numel(), query.numel()
    if capacity == 0 or B == 0:
        return torch.full_like(query, -1)
    if not torch.is_tensor(n_query):
        n_query = torch.full((1,), int(n_query), dtype=torch.int64, device=query.device)
    out = torch.empty(query.shape, dtype=torch.promote_types(slots.dtype, query.dtype), device=query.device)
    # >= 16 lanes: Triton's interpreter before 3.3 ignores the mask of a one-element store
    BLOCK = min(1024 if gpu_shapes(query.device) else 4096, max(16, triton.next_power_of_2(B)))
    n_iters = capacity.bit_length()  # == ceil(log2(capacity + 1))
    slot_lookup_kernel[(triton.cdiv(B, BLOCK),)](
        keys.contiguous(), slots.contiguous(), query.contiguous(), n_query.reshape(1).to(torch.int64), out, B,
        capacity, N_ITERS=n_iters, BLOCK=BLOCK)
    return out


def slot_lookup(keys: torch.Tensor, slots: torch.Tensor, query: torch.Tensor, n_query: torch.Tensor):
    if backend_for(query.device) == "triton":
        with on_device(query):
            return slot_lookup_triton(keys, slots, query, n_query)
    return slot_lookup_torch(keys, slots, query, n_query)
