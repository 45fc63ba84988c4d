"""The victim choice under the CUDA rules: the pool is checked every batch, the whole cache ranked only when the pool
cannot serve the batch, in a fixed sequence of launches gated on the device (kernels/place.py comes before and
after).

The victim pool (cachedemb/cache/victim_pool.py) is a set of slots `pool [:n_pool]` holding every slot whose
score (window protection only) was <= `bound` when it was ranked. Per batch:

1. check (one launch over the pool's capacity): each pool slot's score with this batch's protection (the window's
   `protected` and the batch's hits, `hit_mark`) goes to `sortbuf`, PROTECTED past n_pool; `n_valid` counts the
   scores <= bound. The last block sets `drained` = n_valid < n_admit (the batch needs more victims than the pool
   holds: rank again) and the ranking's target m = min(C, max(size, n_admit + n_hit)).
2. rank (gated on `drained`): the first of six radix passes scores every slot (window protection only) into
   `score [C]` and histograms its top 9 bits; five more passes histogram 11 bits each among the scores matching
   the prefix found so far. The last block of each pass picks the bin holding the m-th smallest score, so the
   next pass reads the prefix directly: after six passes it is that score, T.
3. compact (gated): every slot scoring < T (or == T, a single slot, when T is a real score) becomes the new pool,
   in the order blocks claim positions (an atomic counter); its batch-protected score goes to `sortbuf`,
   PROTECTED past the new n_pool; bound = T.
4. `torch.sort(sortbuf)`: the pool in ascending score; victim r is pool[order[r]], r < n_admit.

Why exact: a pool built at bound T holds the m lowest-scored slots, of which at most n_hit are this batch's hits,
so at least n_admit valid ones (m >= n_admit + n_hit); a pool kept from earlier batches serves only when it
holds n_admit valid scores <= bound, and (for a monotone policy, see victim_pool.py) every slot outside it
scores above bound. So the n_admit lowest of the pool are the whole cache's n_admit lowest, scores being
distinct below PROTECTED. The gated kernels are persistent programs that return at once while the flag reads 0:
a batch the pool serves costs O(pool) and a few idle launches, and every batch launches the same kernels
(CUDA-graph capturable). A policy the kernels cannot score (`kind` None) is scored by `score_fn` (torch ops,
every batch) and the same kernels select from the given scores.

`pool_rank_torch` is the reference (same signature; a host decision instead of the gate; its pool's order may
differ, the victims do not).
"""

import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gpu_shapes, on_device, persistent_programs
from .slot_score import score_of_slots
from .victim_select import PROTECTED

N_PASSES = 6
N_BINS = 2048
# aux [...] (int64, zeroed by the caller): per-batch counts and the radix state, then the passes' histograms
A_DONE_CHECK, A_N_VALID, A_DRAINED, A_M, A_PREFIX, A_K_REM, A_POS = range(7)
A_DONE_PASS = 7  # + pass
A_HIST = 16
AUX_SIZE = A_HIST + N_PASSES * N_BINS


def _shift(i_pass: int) -> int:
    return 55 - 11 * i_pass  # pass 0: bits 55..63 (9 bits), then 11 bits a pass


# ---------------------------------------------------------------- reference


def pool_rank_torch(kind, score_fn, slot_ids, freq, last_use, next_use, protected, hit_mark, tables, pool, pool_state,
                    score, sortbuf, counters, aux, size: int, stale: bool) -> torch.Tensor:
    """Returns `order`: sortbuf's positions in ascending score (victim r = pool[order[r]]). `pool_state` = [n_pool,
    bound, rankings that ran] ([3] int64); `counters` = place.py's (n_hit, n_admit read); `score_fn(slots,
    protected)` scores `slots` (None: all C) under `protected` with the cache's policy (kind: the kernels' code for
    it, or None)."""
    from .place import N_ADMIT, N_HIT

    C = slot_ids.numel() - 1
    cap = sortbuf.numel()
    n_pool = 0 if stale else int(pool_state[0])
    entries = pool[:cap]
    all_protected = protected | hit_mark
    pool_score = score_fn(entries, all_protected[entries])
    valid = torch.arange(cap, device=pool.device) < n_pool
    sortbuf.copy_(torch.where(valid, pool_score, torch.full_like(pool_score, PROTECTED)))
    n_valid = int((valid & (pool_score <= pool_state[1]) & (pool_score < PROTECTED)).sum())
    n_admit, n_hit = int(counters[N_ADMIT]), int(counters[N_HIT])
    if stale:
        pool_state[0] = 0
    if n_valid < n_admit:
        all_scores = score_fn(None, protected[:C])
        score[:C].copy_(all_scores)
        m = min(C, max(size, n_admit + n_hit))
        threshold = torch.sort(all_scores).values[m - 1]
        take = (all_scores < threshold) | ((all_scores == threshold) & (threshold < PROTECTED))
        new = take.nonzero().squeeze(1)
        n_new = new.numel()
        pool[:n_new] = new
        sortbuf.fill_(PROTECTED)
        sortbuf[:n_new] = torch.where(hit_mark[new], torch.full_like(new, PROTECTED), all_scores[new])
        pool_state[0] = n_new
        pool_state[1] = threshold
        pool_state[2] += 1
    return torch.sort(sortbuf).indices


# ---------------------------------------------------------------- Triton


@triton.jit
def _protect(b_score, p_protected, p_hit_mark, o_s, m_s, WITH_HITS: tl.constexpr):
    m_p = tl.load(p_protected + o_s, mask=m_s, other=0) != 0
    if WITH_HITS:
        m_p = m_p | (tl.load(p_hit_mark + o_s, mask=m_s, other=0) != 0)
    return tl.where(m_p, 0x7FFFFFFFFFFFFFFF, b_score)


@triton.jit(do_not_specialize=["cap", "C", "n_tables", "size", "stale"])
def pool_check_kernel(p_ids, p_freq, p_last, p_next, p_protected, p_hit_mark, p_starts, p_ranks, p_given, p_pool,
                      p_state, o_sortbuf, p_cnt, p_aux, cap, C, n_tables, size, stale, KIND: tl.constexpr,
                      HAS_RANK: tl.constexpr, LOG_T: tl.constexpr, BLOCK: tl.constexpr):
    i_b = tl.program_id(0)
    o_j = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_j = o_j < cap
    n_pool = tl.where(stale != 0, 0, tl.load(p_state))
    m_v = m_j & (o_j < n_pool)
    b_s = tl.load(p_pool + o_j, mask=m_v, other=0)
    if KIND >= 0:
        b_score = score_of_slots(p_ids, p_freq, p_last, p_next, p_starts, p_ranks, b_s, m_v, C, n_tables, KIND,
                                 HAS_RANK, LOG_T)
        b_score = _protect(b_score, p_protected, p_hit_mark, b_s, m_v, True)
    else:
        b_score = tl.load(p_given + o_j, mask=m_v, other=0x7FFFFFFFFFFFFFFF)
    b_score = tl.where(m_v, b_score, 0x7FFFFFFFFFFFFFFF)
    tl.store(o_sortbuf + o_j, b_score, mask=m_j)
    m_ok = m_v & (b_score <= tl.load(p_state + 1)) & (b_score < 0x7FFFFFFFFFFFFFFF)
    tl.atomic_add(p_aux + 1, tl.sum(m_ok.to(tl.int64), 0), sem="relaxed")
    if tl.atomic_add(p_aux, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        n_valid = tl.atomic_add(p_aux + 1, 0, sem="relaxed")
        n_admit = tl.load(p_cnt + 4)
        m = tl.minimum(C, tl.maximum(size, n_admit + tl.load(p_cnt + 1)))
        tl.store(p_aux + 2, (n_valid < n_admit).to(tl.int64))
        tl.store(p_aux + 3, m)
        tl.store(p_aux + 5, m)  # k_rem: the rank sought among the scores matching the prefix (0 so far)
        if stale != 0:
            tl.store(p_state, 0)


@triton.jit
def _pick(p_aux, p_hist, SHIFT: tl.constexpr, TOP: tl.constexpr, NB: tl.constexpr):
    """The bin of this pass's histogram holding the k_rem-th smallest matching score extends the prefix; k_rem
    drops by the scores in lower bins."""
    k_rem = tl.load(p_aux + 5)
    o_bin = tl.arange(0, NB)
    b_hist = tl.load(p_hist + o_bin)
    b_incl = tl.cumsum(b_hist, 0)
    b_bin = tl.sum((b_incl < k_rem).to(tl.int64), 0)
    b_below = tl.sum(tl.where(o_bin < b_bin, b_hist, 0), 0)
    if TOP:
        b_bin = b_bin ^ 0x100  # the top digit has its sign bit flipped so digits order like the signed scores
    tl.store(p_aux + 4, tl.load(p_aux + 4) | (b_bin << SHIFT))
    tl.store(p_aux + 5, k_rem - b_below)


@triton.jit(do_not_specialize=["C", "n_tables"])
def rank_pass_kernel(p_ids, p_freq, p_last, p_next, p_protected, p_starts, p_ranks, p_given, p_score, p_aux, C,
                     n_tables, I_PASS: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr, KIND: tl.constexpr,
                     HAS_RANK: tl.constexpr, LOG_T: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
    """Gated on aux's `drained`: pass I_PASS of the radix selection (digit of WIDTH bits at SHIFT; pass 0 also
    scores every slot)."""
    if tl.load(p_aux + 2) != 0:
        prefix = tl.load(p_aux + 4)
        o_bin = tl.arange(0, NB)
        b_acc = tl.zeros([NB], dtype=tl.int64)
        i_b = tl.program_id(0).to(tl.int64)
        n_blocks = tl.cdiv(C, BLOCK)
        while i_b < n_blocks:
            o_s = i_b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            m_s = o_s < C
            if I_PASS == 0:
                if KIND >= 0:
                    b_score = score_of_slots(p_ids, p_freq, p_last, p_next, p_starts, p_ranks, o_s, m_s, C,
                                             n_tables, KIND, HAS_RANK, LOG_T)
                    b_score = _protect(b_score, p_protected, p_protected, o_s, m_s, False)
                else:
                    b_score = tl.load(p_given + o_s, mask=m_s, other=0)
                tl.store(p_score + o_s, b_score, mask=m_s)
                m_live = m_s
            else:
                b_score = tl.load(p_score + o_s, mask=m_s, other=0)
                m_live = m_s & ((((b_score ^ prefix) >> SHIFT) >> WIDTH) == 0)
            b_digit = (b_score >> SHIFT) & ((1 << WIDTH) - 1)
            if I_PASS == 0:
                b_digit = b_digit ^ 0x100
            # no `mask=` (triton < 3.4 lacks it): dead lanes are counted in bin 0, then taken out of it
            b_digit = tl.where(m_live, b_digit, 0).to(tl.int32)
            n_dead = BLOCK - tl.sum(m_live.to(tl.int32), 0)
            b_acc += (tl.histogram(b_digit, NB) - tl.where(o_bin == 0, n_dead, 0)).to(tl.int64)
            i_b += tl.num_programs(0)
        p_hist = p_aux + 16 + I_PASS * NB
        tl.atomic_add(p_hist + o_bin, b_acc, sem="relaxed")
        if tl.atomic_add(p_aux + 7 + I_PASS, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            _pick(p_aux, p_hist, SHIFT, I_PASS == 0, NB)


@triton.jit(do_not_specialize=["C", "cap"])
def rank_compact_kernel(p_score, p_hit_mark, p_aux, p_pool, p_state, o_sortbuf, C, cap, BLOCK: tl.constexpr):
    """Gated: the slots scoring below the threshold T found by the passes (and T's own slot when T is a real
    score) become the pool; sortbuf gets their scores with the batch's hits protected, PROTECTED past them."""
    if tl.load(p_aux + 2) != 0:
        thr = tl.load(p_aux + 4)
        real = thr < 0x7FFFFFFFFFFFFFFF
        n_new = tl.where(real, tl.load(p_aux + 3), tl.load(p_aux + 3) - tl.load(p_aux + 5))
        i_b = tl.program_id(0).to(tl.int64)
        while i_b < tl.cdiv(C, BLOCK):
            o_s = i_b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            m_s = o_s < C
            b_score = tl.load(p_score + o_s, mask=m_s, other=0x7FFFFFFFFFFFFFFF)
            # score < T, or == T when T is a real score: <= T, or <= T - 1 (T = INT64_MAX then, no overflow);
            # tensor compares only (Triton 3.9's interpreter refuses a mask mixed with the scalar `real`)
            m_take = m_s & (b_score <= tl.where(real, thr, thr - 1))
            n_take = tl.sum(m_take.to(tl.int64), 0)
            base = tl.atomic_add(p_aux + 6, n_take, sem="relaxed")
            b_pos = base + tl.cumsum(m_take.to(tl.int64), 0) - 1
            b_hit = tl.load(p_hit_mark + o_s, mask=m_take, other=0) != 0
            tl.store(p_pool + b_pos, o_s, mask=m_take)
            tl.store(o_sortbuf + b_pos, tl.where(b_hit, 0x7FFFFFFFFFFFFFFF, b_score), mask=m_take)
            i_b += tl.num_programs(0)
        i_b = tl.program_id(0).to(tl.int64)
        while i_b < tl.cdiv(cap, BLOCK):
            o_j = i_b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            tl.store(o_sortbuf + o_j, tl.zeros_like(o_j) + 0x7FFFFFFFFFFFFFFF, mask=(o_j < cap) & (o_j >= n_new))
            i_b += tl.num_programs(0)
        if tl.program_id(0) == 0:
            tl.store(p_state, n_new)
            tl.store(p_state + 1, thr)
            tl.store(p_state + 2, tl.load(p_state + 2) + 1)


def rank_block(n: int, device) -> int:
    return 1024 if gpu_shapes(device) else min(8192, max(16, triton.next_power_of_2(n)))


def pool_rank_triton(kind, score_fn, slot_ids, freq, last_use, next_use, protected, hit_mark, tables, pool,
                     pool_state, score, sortbuf, counters, aux, size: int, stale: bool) -> torch.Tensor:
    C = slot_ids.numel() - 1
    cap = sortbuf.numel()
    dev = slot_ids.device
    prot, marks = protected.view(torch.uint8), hit_mark.view(torch.uint8)
    starts, ranks = tables if tables is not None else (slot_ids, slot_ids)  # unread without HAS_RANK
    n_tables = starts.numel() if tables is not None else 1
    meta = dict(KIND=-1 if kind is None else kind, HAS_RANK=tables is not None,
                LOG_T=max(1, int(n_tables).bit_length()))
    given = sortbuf
    if kind is None:  # a policy the kernels cannot score: its scores, with this batch's protection
        given = score_fn(pool[:cap], (protected | hit_mark)[pool[:cap]])
    block = rank_block(cap, dev)
    pool_check_kernel[(triton.cdiv(cap, block),)](
        slot_ids, freq, last_use, next_use, prot, marks, starts, ranks, given, pool, pool_state, sortbuf, counters,
        aux, cap, C, n_tables, size, int(stale), BLOCK=block, **meta)
    given = score
    if kind is None:
        given = score_fn(None, protected[:C])
    block = rank_block(C, dev)
    grid = (persistent_programs(dev, triton.cdiv(C, block)),)
    for i_pass in range(N_PASSES):
        rank_pass_kernel[grid](slot_ids, freq, last_use, next_use, prot, starts, ranks, given, score, aux, C,
                               n_tables, I_PASS=i_pass, SHIFT=_shift(i_pass), WIDTH=9 if i_pass == 0 else 11,
                               BLOCK=block, NB=N_BINS, **meta)
    rank_compact_kernel[grid](score, marks, aux, pool, pool_state, sortbuf, C, cap, BLOCK=block)
    return torch.sort(sortbuf).indices


def pool_rank(kind, score_fn, slot_ids, freq, last_use, next_use, protected, hit_mark, tables, pool, pool_state,
              score, sortbuf, counters, aux, size: int, stale: bool) -> torch.Tensor:
    if backend_for(slot_ids.device) == "triton":
        with on_device(slot_ids):
            return pool_rank_triton(kind, score_fn, slot_ids, freq, last_use, next_use, protected, hit_mark, tables,
                                    pool, pool_state, score, sortbuf, counters, aux, size, stale)
    return pool_rank_torch(kind, score_fn, slot_ids, freq, last_use, next_use, protected, hit_mark, tables, pool,
                           pool_state, score, sortbuf, counters, aux, size, stale)
