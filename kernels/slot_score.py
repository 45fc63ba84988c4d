"""Eviction scores of every cache slot for the built-in policies, in one launch gated by a device flag.

A full ranking scores all C slots. Written as torch ops (cachedemb/cache/policy.py, the reference) that is a dozen
passes over C; here it is one. The gate lets a caller that cannot read a device count (CUDA, the sync-free mode)
launch the ranking every batch and have it run only when the flag says the victim pool ran dry: the grid is a
fixed set of persistent programs whose work count is `C` or 0 as the flag reads, so a batch that does not need
the ranking costs a few idle programs, not O(cache), and a step with fixed shapes launches the same grid every
time (CUDA-graph capturable).

The scores equal the policy functions' bit for bit (tests/kernels/test_slot_score.py), including the table rank
that `lookahead` reads: a binary search of each slot's id in the tables' first ids, as `torch.searchsorted`.
"""
import torch
from .lazy_triton import tl, triton

from .dispatch import gate_bytes, gpu_shapes, on_device, persistent_programs

SCORE_LFU, SCORE_LRU, SCORE_LOOKAHEAD = 0, 1, 2
SCORE_KINDS = (SCORE_LFU, SCORE_LRU, SCORE_LOOKAHEAD)

@triton.jit
def _table_rank(p_starts, p_ranks, b_id, n_tables, LOG_T: tl.constexpr):
    # searchsorted(starts, id, right=True) - 1: the last table whose first id is <= id (starts[0] = 0)
    b_lo = tl.zeros_like(b_id)
    b_hi = tl.zeros_like(b_id) + n_tables
    for _ in tl.static_range(LOG_T):
        b_mid = (b_lo + b_hi) // 2
        m_go = b_hi - b_lo > 1
        b_start = tl.load(p_starts + b_mid, mask=m_go, other=0)
        b_lo = tl.where(m_go & (b_start <= b_id), b_mid, b_lo)
        b_hi = tl.where(m_go & (b_start > b_id), b_mid, b_hi)
    return tl.load(p_ranks + b_lo)


@triton.jit
def score_of_slots(p_ids, p_freq, p_last, p_next, p_starts, p_ranks, o_s, m_s, C, n_tables, KIND: tl.constexpr,
                   HAS_RANK: tl.constexpr, LOG_T: tl.constexpr):
    """Scores of slots o_s (int64, mask m_s) under policy KIND before protection: cachedemb.cache.policy's
    arithmetic, bit for bit. Tiers: TIER = 2^32, counts capped at 2 TIER - 1 (lfu, lru) or 2^24 - 1 (lookahead)."""
    b_id = tl.load(p_ids + o_s, mask=m_s, other=-1)
    if KIND == 0:  # lfu
        b_key = tl.minimum(tl.load(p_freq + o_s, mask=m_s, other=0), 8589934591)
    elif KIND == 1:  # lru
        b_key = tl.minimum(tl.load(p_last + o_s, mask=m_s, other=0), 8589934591)
    else:  # lookahead: no use in the horizon by count (and table rank), then the furthest next use first
        b_next = tl.load(p_next + o_s, mask=m_s, other=-1)
        b_far = 4294967296 + (4294967295 - tl.minimum(tl.maximum(b_next, 0), 4294967295))
        b_rank = tl.zeros_like(b_id)
        if HAS_RANK:
            b_rank = _table_rank(p_starts, p_ranks, tl.maximum(b_id, 0), n_tables, LOG_T)
        b_freq = tl.load(p_freq + o_s, mask=m_s, other=0)
        b_count = tl.minimum(b_freq, 16777215) * 256 + tl.minimum(b_rank, 255)
        b_key = tl.where(b_next < 0, b_count, b_far)
    b_score = b_key * C + o_s
    return tl.where(b_id < 0, o_s - C, b_score)


@triton.jit(do_not_specialize=["C", "n_tables"])
def slot_score_kernel(p_ids, p_freq, p_last, p_next, p_protected, p_starts, p_ranks, p_gate, o_score, C,
                      n_tables, KIND: tl.constexpr, HAS_RANK: tl.constexpr, LOG_T: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Persistent programs over the C slots in BLOCK runs; no work when the gate reads 0."""
    n_blocks = tl.where(tl.load(p_gate) != 0, tl.cdiv(C, BLOCK), 0)
    i_b = tl.program_id(0).to(tl.int64)
    while i_b < n_blocks:
        o_i = i_b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m_i = o_i < C
        b_score = score_of_slots(p_ids, p_freq, p_last, p_next, p_starts, p_ranks, o_i, m_i, C, n_tables, KIND,
                                 HAS_RANK, LOG_T)
        b_prot = tl.load(p_protected + o_i, mask=m_i, other=0) != 0
        b_score = tl.where(b_prot, 0x7FFFFFFFFFFFFFFF, b_score)
        tl.store(o_score + o_i, b_score, mask=m_i)
        i_b += tl.num_programs(0)


def slot_score_triton(kind: int, slot_ids, freq, last_use, next_use, protected, tables=None, gate=None,
                      out=None):
    """Scores [C] int64 of all C slots under `kind` (SCORE_*). `tables` = (first id of each table, its rank) as
    the cache's set_tables keeps them (lookahead reads them); `gate` an int/bool [1] device flag: 0 leaves `out`
    untouched (allocated uninitialized when not given)."""
    if kind not in SCORE_KINDS:
        raise ValueError(f"score kind {kind!r}: expected one of {SCORE_KINDS}")
    C = slot_ids.numel()
    dev = slot_ids.device
    score = torch.empty(C, dtype=torch.int64, device=dev) if out is None else out
    if C == 0:
        return score
    gate = gate_bytes(gate, dev)
    starts, ranks = tables if tables is not None else (slot_ids, slot_ids)  # unread without HAS_RANK
    n_tables = starts.numel() if tables is not None else 1
    BLOCK = 1024 if gpu_shapes(dev) else min(8192, max(16, triton.next_power_of_2(C)))
    grid = (persistent_programs(dev, triton.cdiv(C, BLOCK)),)
    with on_device(slot_ids):
        slot_score_kernel[grid](slot_ids, freq, last_use, next_use, protected.view(torch.uint8), starts, ranks,
                                gate, score, C, n_tables, KIND=kind, HAS_RANK=tables is not None,
                                LOG_T=max(1, int(n_tables).bit_length()), BLOCK=BLOCK)
    return score
