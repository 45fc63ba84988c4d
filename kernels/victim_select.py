"""Victim selection: the k cache slots with the smallest eviction scores, ascending.

Scores are int64 and distinct (policies fold the slot index into the low bits), so the choice is deterministic.
A protected slot carries INT64_MAX; callers take only as many victims as there are unprotected slots.
"""

import numpy as np
import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gate_bytes, gpu_shapes, on_device, persistent_programs

PROTECTED = torch.iinfo(torch.int64).max


def victim_select_torch(score: torch.Tensor, k: int, host_sizes: bool = False):
    """Reference: the k smallest scores. Returns int64 slots [k], smallest score first (scores are distinct, so
    any exact method gives the same slots). With `host_sizes` (CPU, counts free to read) a large C is first cut
    down to the scores at or below a threshold estimated from a strided sample, so ~k candidates are sorted
    rather than all C partitioned; a short cut falls back to the plain top-k."""
    n = score.numel()
    k = min(int(k), n)
    if host_sizes and n >= _CUT_MIN and 0 < k <= n // 4:
        sample = score[:: n // _CUT_SAMPLE]
        q = min(sample.numel(), int(sample.numel() * k * 1.25 / n) + 16)  # a margin above k/n
        threshold = torch.kthvalue(sample, q).values
        if score.device.type == "cpu" and not score.requires_grad:
            # numpy's mask-to-positions is ~3x torch's nonzero on CPU (0.23 vs 0.8 ms over 400k scores)
            cand = torch.from_numpy(np.flatnonzero(score.contiguous().numpy() <= int(threshold)))
        else:
            cand = (score <= threshold).nonzero().squeeze(1)
        if k <= cand.numel() <= n // 2:
            return cand[_k_smallest(score[cand], k)]
    return _k_smallest(score, k)


def _k_smallest(score: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k smallest scores, smallest first: `torch.topk(largest=False)`'s (distinct scores: one
    answer). On CPU topk is slow: where k is most of the scores (a threshold cut's candidates) one `torch.sort`
    of them all (~1 ms for 69k at a 5% cache's window, where topk took 2.2 and numpy's argsort 3.1), else numpy's
    partition, then that sort of the k."""
    n = score.numel()
    if score.device.type != "cpu" or k <= 0 or k >= n or score.requires_grad:
        return torch.topk(score, k, largest=False, sorted=True).indices
    if 2 * k >= n:
        return torch.sort(score, stable=True).indices[:k]
    part = torch.from_numpy(np.argpartition(score.contiguous().numpy(), k - 1)[:k]).to(torch.int64)
    return part[torch.sort(score[part], stable=True).indices]


_CUT_MIN = 1 << 17  # below this, a plain top-k
_CUT_SAMPLE = 4096

RADIX_BITS = 8  # the kernels below are written for 8-bit digits (0xFF, 256 bins)
N_BINS = 1 << RADIX_BITS
N_PASSES = 64 // RADIX_BITS


@triton.jit
def _prefix_match(b_score, prefix, shift):
    # Scores whose bits above `shift + 8` equal the prefix found so far (all of them in the first pass).
    b_hi = ((b_score ^ prefix) >> shift) >> 8  # two shifts: one by 64 would be undefined
    return (b_hi == 0) | (shift + 8 >= 64)


@triton.jit
def _radix_digit(b_score, shift):
    # 8-bit digit at `shift`; the top digit has its sign bit flipped so digits order like the signed scores.
    b_digit = (b_score >> shift) & 0xFF
    b_digit = tl.where(shift + 8 >= 64, b_digit ^ 0x80, b_digit)
    return b_digit.to(tl.int32)


@triton.jit(do_not_specialize=["C", "shift"])
def radix_hist_kernel(p_score, p_state, p_gate, o_hist, C, shift, BLOCK: tl.constexpr):
    """Histogram of the digit at `shift` over the scores that still match the prefix; p_state = [prefix, k_rem].
    Persistent programs over the BLOCK runs, each adding its own histogram once; no work when the gate reads 0."""
    n_blocks = tl.where(tl.load(p_gate) != 0, tl.cdiv(C, BLOCK), 0)
    prefix = tl.load(p_state)
    o_bin = tl.arange(0, 256)
    b_acc = tl.zeros([256], dtype=tl.int64)
    i_b = tl.program_id(0).to(tl.int64)
    while i_b < n_blocks:
        o_i = i_b * BLOCK + tl.arange(0, BLOCK)
        m_i = o_i < C
        b_score = tl.load(p_score + o_i, mask=m_i, other=0)
        m_live = m_i & _prefix_match(b_score, prefix, shift)
        # no `mask=` (triton < 3.4 lacks it): dead lanes are counted in bin 0, then taken out of it
        b_digit = tl.where(m_live, _radix_digit(b_score, shift), 0)
        n_dead = BLOCK - tl.sum(m_live.to(tl.int32), 0)
        b_acc += (tl.histogram(b_digit, 256) - tl.where(o_bin == 0, n_dead, 0)).to(tl.int64)
        i_b += tl.num_programs(0)
    if tl.program_id(0) < n_blocks:
        tl.atomic_add(o_hist + o_bin, b_acc, sem="relaxed")


@triton.jit(do_not_specialize=["shift"])
def radix_pick_kernel(p_hist, p_state, p_gate, shift):
    """One program: the bin holding the k_rem-th smallest live score extends the prefix; k_rem drops by the
    scores in lower bins."""
    if tl.load(p_gate) != 0:
        prefix = tl.load(p_state)
        k_rem = tl.load(p_state + 1)
        o_bin = tl.arange(0, 256)
        b_hist = tl.load(p_hist + o_bin)
        b_incl = tl.cumsum(b_hist, 0)
        b_bin = tl.sum((b_incl < k_rem).to(tl.int64), 0)
        b_below = tl.sum(tl.where(o_bin < b_bin, b_hist, 0), 0)
        b_raw = tl.where(shift + 8 >= 64, b_bin ^ 0x80, b_bin)
        tl.store(p_state, prefix | (b_raw << shift))
        tl.store(p_state + 1, k_rem - b_below)


@triton.jit(do_not_specialize=["C"])
def threshold_count_kernel(p_score, p_state, p_gate, o_count, C, BLOCK: tl.constexpr):
    """Per block: how many scores are below the threshold and how many equal it (persistent, gated)."""
    n_blocks = tl.where(tl.load(p_gate) != 0, tl.cdiv(C, BLOCK), 0)
    b_thr = tl.load(p_state)
    i_b = tl.program_id(0).to(tl.int64)
    while i_b < n_blocks:
        o_i = i_b * BLOCK + tl.arange(0, BLOCK)
        m_i = o_i < C
        b_score = tl.load(p_score + o_i, mask=m_i, other=0)
        tl.store(o_count + 2 * i_b, tl.sum((m_i & (b_score < b_thr)).to(tl.int64), 0))
        tl.store(o_count + 2 * i_b + 1, tl.sum((m_i & (b_score == b_thr)).to(tl.int64), 0))
        i_b += tl.num_programs(0)


@triton.jit(do_not_specialize=["C", "k"])
def threshold_compact_kernel(p_score, p_state, p_gate, p_base, o_score, o_slot, C, k, BLOCK: tl.constexpr):
    """Write every score below the threshold and the first k_rem (by slot) equal to it into k candidates, in slot
    order: those below at [0, k - k_rem), the ties after them. p_base holds each block's exclusive offsets.
    Persistent, gated."""
    n_blocks = tl.where(tl.load(p_gate) != 0, tl.cdiv(C, BLOCK), 0)
    b_thr = tl.load(p_state)
    n_below = k - tl.load(p_state + 1)
    i_b = tl.program_id(0).to(tl.int64)
    while i_b < n_blocks:
        o_i = i_b * BLOCK + tl.arange(0, BLOCK)
        m_i = o_i < C
        b_score = tl.load(p_score + o_i, mask=m_i, other=0)
        m_lt = m_i & (b_score < b_thr)
        m_eq = m_i & (b_score == b_thr)
        b_pos_lt = tl.load(p_base + 2 * i_b) + tl.cumsum(m_lt.to(tl.int64), 0) - 1
        b_pos_eq = n_below + tl.load(p_base + 2 * i_b + 1) + tl.cumsum(m_eq.to(tl.int64), 0) - 1
        b_pos = tl.where(m_lt, b_pos_lt, b_pos_eq)
        m_out = m_lt | (m_eq & (b_pos_eq < k))
        tl.store(o_score + b_pos, b_score, mask=m_out)
        tl.store(o_slot + b_pos, o_i, mask=m_out)
        i_b += tl.num_programs(0)


def victim_select_triton(score: torch.Tensor, k: int, gate: torch.Tensor | None = None):
    """Same slots as `victim_select_torch` without sorting the C scores: 8 radix passes find the k-th smallest
    score (the threshold), a two-kernel compaction gathers the k candidates, and only those k are sorted.
    Equal scores (several PROTECTED) resolve to the lowest slots. The O(C) kernels are persistent programs
    (a grid sized by the machine) that do no work while the [1] device flag `gate` reads 0: the k slots returned
    then are all 0 (valid indices, to be discarded), at O(k) cost."""
    C = score.numel()
    k = min(int(k), C)
    dev = score.device
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    score = score.reshape(-1).to(torch.int64).contiguous()
    gate = gate_bytes(gate, dev)
    # >= 16 lanes: Triton's interpreter ignores the mask of a one-element store before 3.3, and returns a tuple
    # from a one-element tl.cumsum before 3.4
    BLOCK = min(1024 if gpu_shapes(dev) else 8192, max(16, triton.next_power_of_2(C)))
    n_blocks = triton.cdiv(C, BLOCK)
    grid = (persistent_programs(dev, n_blocks),)
    state = torch.zeros(2, dtype=torch.int64, device=dev)  # [prefix of the k-th smallest score, rank left]
    state[1:].fill_(k)
    hist = torch.zeros(N_PASSES, N_BINS, dtype=torch.int64, device=dev)
    for i_pass in range(N_PASSES):
        shift = 64 - RADIX_BITS * (i_pass + 1)
        radix_hist_kernel[grid](score, state, gate, hist[i_pass], C, shift, BLOCK=BLOCK)
        radix_pick_kernel[(1,)](hist[i_pass], state, gate, shift)
    block_count = torch.zeros(n_blocks, 2, dtype=torch.int64, device=dev)
    threshold_count_kernel[grid](score, state, gate, block_count, C, BLOCK=BLOCK)
    block_base = torch.cumsum(block_count, 0) - block_count
    cand_score = torch.zeros(k, dtype=torch.int64, device=dev)
    cand_slot = torch.zeros(k, dtype=torch.int64, device=dev)
    threshold_compact_kernel[grid](score, state, gate, block_base, cand_score, cand_slot, C, k, BLOCK=BLOCK)
    order = torch.sort(cand_score, stable=True).indices
    return cand_slot[order]


def victim_select(score: torch.Tensor, k: int, host_sizes: bool = False, gate: torch.Tensor | None = None):
    """`host_sizes`: the caller may read counts on the host (CPU outside the sync-free mode). `gate`: a [1]
    device flag; where it reads 0 the result is unspecified (valid slot indices) and the Triton backend skips
    the O(C) work; the reference computes the selection either way."""
    if backend_for(score.device) == "triton":
        with on_device(score):
            return victim_select_triton(score, k, gate)
    return victim_select_torch(score, k, host_sizes)
