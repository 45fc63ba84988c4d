"""A batch's placement under the CUDA rules in two launches around the victim choice: `place_lookup` before it,
`place_commit` after it.

`place_lookup`, per distinct id u < n_uniq (capacity U): find its slot in the id index; a hit is marked in
`hit_mark` (its slot is protected for this batch, apart from the window's `protected`) and keeps its slot in
`loc_u`; a miss gets -1. Counts go to `counters` = [done, n_hit, n_miss, n_newly, n_admit, rebuild] (zeroed by
the caller): n_newly = hits not already window-protected; the last block to finish writes n_admit = min(n_miss,
free slots = C - n_protected - n_newly), turns each block's miss count (`bmiss[:blocks]`) into exclusive offsets
(`bmiss[blocks:]`: a miss's rank among the misses is its block's offset + the misses before it in the block),
and decides whether the index must be rebuilt before the misses are inserted (`used` + n_miss > `limit`: then
`rebuild` = 1 and `used` = 0, see id_index.index_rebuild).

`place_commit`, per distinct id: a hit bumps its slot's count and last use (`train`) and drops its batch mark;
the miss of rank r < n_admit takes victim r = pool[order[r]] (the victim choice: slots in ascending score): the
victim's id leaves the index, the miss's id enters it (one compare-and-swap claim; an id that finds no position
within MAX_PROBE is served from the host and its victim slot left empty), the slot metadata changes and the row
move is recorded (RowMove's buffers, rank order); misses past n_admit are served from the host (HOST_LOC - id),
their counts added to the host's with `train`. `stats` gets evictions, rows in and out, host rows (and, with
`count_lookups`, lookups / unique / hits / misses from place_lookup).

Both have a torch reference of the same signature (`*_torch`); the Triton index layout may differ from the
reference's (compare-and-swap claims in GPU order), every other output is the same.
"""

import torch
from .lazy_triton import tl, triton

from .dispatch import backend_for, gpu_shapes, on_device
from .gather import take
from .id_index import MAX_PROBE, _mix, _tombstone, index_find_torch, index_insert_torch, probe_find, probe_insert
from .pooled_forward import HOST_LOC

# counters[...]: per-batch device counts (int64, zeroed by the caller)
DONE, N_HIT, N_MISS, N_NEWLY, N_ADMIT, REBUILD = range(6)
N_COUNTERS = 6
# the cache's statistics a placement adds to, by name -> index in `stats` (the caller's layout)
STAT_KEYS = ("lookups", "unique", "hits", "misses", "evictions", "rows_in", "rows_out", "host_rows")


def place_block(U: int, device) -> int:
    # >= 16 lanes: Triton's interpreter before 3.3 ignores the mask of a one-element store
    return min(256 if gpu_shapes(device) else 4096, max(16, triton.next_power_of_2(U)))


def bmiss_size(U: int, device) -> int:
    """Elements of `bmiss` for U distinct-id positions: a count and an offset per block."""
    return 2 * triton.cdiv(max(U, 1), place_block(U, device))


# ---------------------------------------------------------------- reference


def place_lookup_torch(keys, uniq, counts, n_uniq, protected, hit_mark, loc_u, bmiss, counters, stats, stat_index,
                       used, n_protected, limit: int, count_lookups: bool, admit: bool = True) -> None:
    C = hit_mark.numel() - 1
    U = uniq.numel()
    slot = index_find_torch(keys, uniq, n_uniq)[1]
    live = torch.arange(U, device=uniq.device) < n_uniq
    hit = live & (slot >= 0)
    miss = live & (slot < 0)
    hit_slots = torch.where(hit, slot, torch.full_like(slot, C))
    newly = hit & take(protected, hit_slots).logical_not()
    hit_mark.index_fill_(0, hit_slots, True)
    hit_mark[C] = False
    loc_u.copy_(torch.where(hit, slot, torch.full_like(slot, -1)))
    block = place_block(U, uniq.device)
    blocks = bmiss.numel() // 2
    per_block = torch.zeros(blocks * block, dtype=torch.int64, device=uniq.device)
    per_block[:U] = miss.to(torch.int64)
    per_block = per_block.view(blocks, block).sum(1)
    bmiss[:blocks] = per_block
    bmiss[blocks:] = torch.cumsum(per_block, 0) - per_block
    n_hit, n_miss, n_newly = hit.sum(), miss.sum(), newly.sum()
    counters[N_HIT] += n_hit
    counters[N_MISS] += n_miss
    counters[N_NEWLY] += n_newly
    counters[N_ADMIT] = torch.minimum(n_miss, C - n_protected.reshape(()) - n_newly) if admit else 0
    counters[DONE] += blocks
    if count_lookups:
        stats[stat_index["lookups"]] += torch.where(live, counts, 0).sum()
        stats[stat_index["unique"]] += n_uniq.reshape(())
        stats[stat_index["hits"]] += n_hit
        stats[stat_index["misses"]] += n_miss
    rebuild = (used.reshape(()) + n_miss > limit) & admit
    counters[REBUILD] = rebuild.to(torch.int64)
    used.copy_(torch.where(rebuild, torch.zeros_like(used), used))


def place_commit_torch(keys, uniq, counts, n_uniq, loc_u, bmiss, order, pool, counters, slot_ids, slot_freq,
                       slot_last_use, dirty, hit_mark, host_freq, move, stats, stat_index, used, clock: int,
                       train: bool) -> None:
    """`move` = (victims, old_ids, dirty_ids, miss_ids, miss_dest, add): the RowMove buffers ([U] each, rank
    order) and the counts the fill adds to the admitted rows' (`add`)."""
    victims, old_ids, dirty_ids, miss_ids, miss_dest, add = move
    C = hit_mark.numel() - 1
    U = uniq.numel()
    dev = uniq.device
    live = torch.arange(U, device=dev) < n_uniq
    hit = live & (loc_u >= 0)
    miss = live & (loc_u < 0)
    hit_slots = torch.where(hit, loc_u, torch.full_like(loc_u, C))
    if train:
        slot_freq.index_add_(0, hit_slots, torch.where(hit, counts, 0))
        slot_last_use.index_fill_(0, hit_slots, clock)
    hit_mark.index_fill_(0, hit_slots, False)
    n_admit = counters[N_ADMIT]
    rank = torch.cumsum(miss.to(torch.int64), 0) - 1
    admitted = miss & (rank < n_admit)
    r_adm = torch.where(admitted, rank, torch.full_like(rank, U))  # U: a dump past the rank buffers
    ranks = torch.arange(U, device=dev)
    used_r = ranks < n_admit
    at = take(order, torch.where(used_r, ranks, 0)).clamp(0, pool.numel() - 1)  # (unused ranks: any position)
    v = torch.where(used_r, take(pool, at), torch.full_like(ranks, C))
    old = torch.where(used_r, take(slot_ids, v), torch.full_like(v, -1))
    was_dirty = take(dirty, v) & (old >= 0)
    index_delete_ids = torch.where(used_r, old, torch.full_like(old, -1))
    _tombstone(keys, index_find_torch(keys, index_delete_ids, U)[0])
    # the miss of rank r (r < n_admit) into victim r
    miss_of_rank = torch.full((U + 1,), -1, dtype=torch.int64, device=dev)
    miss_of_rank.index_put_((r_adm,), uniq)
    ids_r = miss_of_rank[:U]
    ok = index_insert_torch(keys, torch.where(used_r, ids_r, -1), v.clamp(max=C - 1), U, False, used)
    placed = used_r & ok
    dest = torch.where(placed, v, torch.full_like(v, -1))
    victims.copy_(torch.where(used_r, v, 0))
    old_ids.copy_(old)
    dirty_ids.copy_(torch.where(used_r & was_dirty, old, torch.full_like(old, -1)))
    # every miss in rank order (those past n_admit are served from the host: no slot)
    all_rank = torch.where(miss, rank, torch.full_like(rank, U))
    ids_all = torch.full((U + 1,), -1, dtype=torch.int64, device=dev)
    ids_all.index_put_((all_rank,), uniq)
    miss_ids.copy_(ids_all[:U])
    miss_dest.copy_(dest)
    cnt_r = torch.zeros(U + 1, dtype=torch.int64, device=dev)
    cnt_r.index_put_((all_rank,), counts)
    add.copy_(torch.where(placed, cnt_r[:U], 0) if train else torch.zeros_like(add))
    dump = torch.where(used_r, v, torch.full_like(v, C))
    slot_ids.index_put_((dump,), torch.where(placed, ids_r, torch.full_like(ids_r, -1)))
    dirty.index_fill_(0, dump, False)
    slot_last_use.index_put_((torch.where(placed, v, torch.full_like(v, C)),), torch.full_like(v, clock))
    slot_ids[C], dirty[C] = -1, False
    # locations: hits kept; placed misses their victim; the rest of the misses on the host
    placed_u = torch.zeros(U + 1, dtype=torch.bool, device=dev)
    placed_u[:U] = placed
    slot_u = torch.full((U + 1,), -1, dtype=torch.int64, device=dev)
    slot_u[:U] = v
    at = torch.where(miss, rank, torch.full_like(rank, U))
    on_slot = miss & placed_u[at]
    new_loc = torch.where(on_slot, slot_u[at], torch.where(miss, HOST_LOC - uniq, torch.full_like(uniq, -1)))
    new_loc = torch.where(hit, loc_u, new_loc)
    loc_u.copy_(new_loc)
    host_served = miss & on_slot.logical_not()
    if train:
        ids = torch.where(host_served, uniq, 0)
        host_freq.index_add_(0, ids.to(host_freq.device), torch.where(host_served, counts, 0).to(host_freq.device))
    stats[stat_index["evictions"]] += (used_r & (old >= 0)).sum()
    stats[stat_index["rows_out"]] += (used_r & was_dirty).sum()
    stats[stat_index["rows_in"]] += placed.sum()
    stats[stat_index["host_rows"]] += host_served.sum()


# ---------------------------------------------------------------- Triton


@triton.jit(do_not_specialize=["U", "C", "limit"])
def place_lookup_kernel(p_keys, p_uniq, p_counts, p_n_uniq, p_protected, p_hit_mark, o_loc, p_bmiss, p_cnt,
                        p_stats, p_used, p_n_protected, U, C, limit, MASK, S_LOOKUPS: tl.constexpr,
                        S_UNIQUE: tl.constexpr, S_HITS: tl.constexpr, S_MISSES: tl.constexpr,
                        COUNT_LOOKUPS: tl.constexpr, ADMIT: tl.constexpr, BLOCK: tl.constexpr,
                        SCAN: tl.constexpr):
    i_b = tl.program_id(0)
    n_blocks = tl.num_programs(0)
    o_u = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_u = o_u < U
    n_uniq = tl.load(p_n_uniq)
    m_live = m_u & (o_u < n_uniq)
    b_id = tl.load(p_uniq + o_u, mask=m_live, other=-1)
    _, b_slot = probe_find(p_keys, b_id, m_live & (b_id >= 0), MASK)
    m_hit = m_live & (b_slot >= 0)
    m_miss = m_live & (b_slot < 0)
    b_was = tl.load(p_protected + b_slot, mask=m_hit, other=1) != 0
    tl.store(p_hit_mark + b_slot, tl.full([BLOCK], 1, tl.int8), mask=m_hit)
    tl.store(o_loc + o_u, tl.where(m_hit, b_slot, -1), mask=m_u)
    n_hit = tl.sum(m_hit.to(tl.int64), 0)
    n_miss = tl.sum(m_miss.to(tl.int64), 0)
    tl.store(p_bmiss + i_b, n_miss)
    tl.atomic_add(p_cnt + 1, n_hit, sem="relaxed")
    tl.atomic_add(p_cnt + 2, n_miss, sem="relaxed")
    tl.atomic_add(p_cnt + 3, tl.sum((m_hit & (b_was == 0)).to(tl.int64), 0), sem="relaxed")
    if COUNT_LOOKUPS:
        b_count = tl.load(p_counts + o_u, mask=m_live, other=0)
        tl.atomic_add(p_stats + S_LOOKUPS, tl.sum(b_count, 0), sem="relaxed")
        tl.atomic_add(p_stats + S_HITS, n_hit, sem="relaxed")
        tl.atomic_add(p_stats + S_MISSES, n_miss, sem="relaxed")
        if i_b == 0:
            tl.atomic_add(p_stats + S_UNIQUE, n_uniq, sem="relaxed")
    if tl.atomic_add(p_cnt, 1, sem="acq_rel") == n_blocks - 1:  # the last block: every count is in
        b_carry = tl.zeros([], dtype=tl.int64)
        for j in range(0, n_blocks, SCAN):
            o_j = j + tl.arange(0, SCAN)
            b_c = tl.load(p_bmiss + o_j, mask=o_j < n_blocks, other=0)
            tl.store(p_bmiss + n_blocks + o_j, b_carry + tl.cumsum(b_c, 0) - b_c, mask=o_j < n_blocks)
            b_carry += tl.sum(b_c, 0)
        if ADMIT:
            n_free = C - tl.load(p_n_protected) - tl.atomic_add(p_cnt + 3, 0, sem="relaxed")
            tl.store(p_cnt + 4, tl.minimum(b_carry, n_free))
            go = tl.load(p_used) + b_carry > limit
            tl.store(p_cnt + 5, go.to(tl.int64))
            if go:
                tl.store(p_used, 0)


@triton.jit(do_not_specialize=["U", "clock"])
def place_commit_kernel(p_keys, p_uniq, p_counts, p_n_uniq, p_loc, p_bmiss, p_order, p_pool, p_cnt, p_slot_ids,
                        p_freq, p_last, p_dirty, p_hit_mark, p_host_freq, o_victims, o_old, o_dirty_ids, o_miss_ids,
                        o_miss_dest, o_add, p_stats, p_used, U, clock, MASK, S_EVICT: tl.constexpr,
                        S_IN: tl.constexpr, S_OUT: tl.constexpr, S_HOST: tl.constexpr, TRAIN: tl.constexpr,
                        MAX_P: tl.constexpr, BLOCK: tl.constexpr):
    i_b = tl.program_id(0)
    o_u = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_u = o_u < U
    m_live = m_u & (o_u < tl.load(p_n_uniq))
    b_loc = tl.load(p_loc + o_u, mask=m_live, other=-1)
    b_id = tl.load(p_uniq + o_u, mask=m_live, other=-1)
    b_count = tl.load(p_counts + o_u, mask=m_live, other=0)
    m_hit = m_live & (b_loc >= 0)
    m_miss = m_live & (b_loc < 0)
    if TRAIN:
        b_f = tl.load(p_freq + b_loc, mask=m_hit, other=0)
        tl.store(p_freq + b_loc, b_f + b_count, mask=m_hit)
        tl.store(p_last + b_loc, tl.zeros_like(b_loc) + clock, mask=m_hit)
    tl.store(p_hit_mark + b_loc, tl.zeros([BLOCK], tl.int8), mask=m_hit)
    # the miss of rank r < n_admit takes victim r
    b_rank = tl.load(p_bmiss + tl.num_programs(0) + i_b) + tl.cumsum(m_miss.to(tl.int64), 0) - 1
    m_adm = m_miss & (b_rank < tl.load(p_cnt + 4))
    b_v = tl.load(p_pool + tl.load(p_order + b_rank, mask=m_adm, other=0), mask=m_adm, other=0)
    b_old = tl.load(p_slot_ids + b_v, mask=m_adm, other=-1)
    m_dirty = m_adm & (b_old >= 0) & (tl.load(p_dirty + b_v, mask=m_adm, other=0) != 0)
    b_pos, _ = probe_find(p_keys, b_old, m_adm & (b_old >= 0), MASK)
    tl.store(p_keys + b_pos, tl.zeros_like(b_pos) - 2, mask=b_pos >= 0)
    m_ok, m_new = probe_insert(p_keys, (tl.maximum(b_id, 0) << 30) | b_v, _mix(b_id) & MASK, m_adm, MASK, MAX_P)
    tl.atomic_add(p_used, tl.sum(m_new.to(tl.int64), 0), sem="relaxed")
    tl.store(p_slot_ids + b_v, tl.where(m_ok, b_id, -1), mask=m_adm)
    tl.store(p_dirty + b_v, tl.zeros([BLOCK], tl.int8), mask=m_adm)
    tl.store(p_last + b_v, tl.zeros_like(b_v) + clock, mask=m_ok)
    tl.store(o_victims + b_rank, b_v, mask=m_adm)
    tl.store(o_old + b_rank, b_old, mask=m_adm)
    tl.store(o_dirty_ids + b_rank, tl.where(m_dirty, b_old, -1), mask=m_adm)
    tl.store(o_miss_ids + b_rank, b_id, mask=m_miss)
    tl.store(o_miss_dest + b_rank, tl.where(m_ok, b_v, -1), mask=m_miss)
    if TRAIN:
        tl.store(o_add + b_rank, tl.where(m_ok, b_count, 0), mask=m_miss)
    else:
        tl.store(o_add + b_rank, tl.zeros_like(b_count), mask=m_miss)
    m_host = m_miss & (m_ok == 0)
    tl.store(p_loc + o_u, tl.where(m_ok, b_v, -2 - b_id), mask=m_miss)  # HOST_LOC - id
    if TRAIN:
        b_hf = tl.load(p_host_freq + b_id, mask=m_host, other=0)
        tl.store(p_host_freq + b_id, b_hf + b_count, mask=m_host)
    tl.atomic_add(p_stats + S_EVICT, tl.sum((m_adm & (b_old >= 0)).to(tl.int64), 0), sem="relaxed")
    tl.atomic_add(p_stats + S_OUT, tl.sum(m_dirty.to(tl.int64), 0), sem="relaxed")
    tl.atomic_add(p_stats + S_IN, tl.sum(m_ok.to(tl.int64), 0), sem="relaxed")
    tl.atomic_add(p_stats + S_HOST, tl.sum(m_host.to(tl.int64), 0), sem="relaxed")


def _stat_constexprs(stat_index, names):
    return {f"S_{short}": stat_index[name] for short, name in names}


def place_lookup_triton(keys, uniq, counts, n_uniq, protected, hit_mark, loc_u, bmiss, counters, stats, stat_index,
                        used, n_protected, limit: int, count_lookups: bool, admit: bool = True) -> None:
    U, C = uniq.numel(), hit_mark.numel() - 1
    block = place_block(U, uniq.device)
    n_blocks = triton.cdiv(U, block)
    consts = _stat_constexprs(stat_index, [("LOOKUPS", "lookups"), ("UNIQUE", "unique"), ("HITS", "hits"),
                                           ("MISSES", "misses")])
    place_lookup_kernel[(n_blocks,)](
        keys, uniq, counts, n_uniq, protected.view(torch.uint8), hit_mark.view(torch.uint8), loc_u, bmiss, counters,
        stats, used, n_protected, U, C, limit, keys.numel() - 1, COUNT_LOOKUPS=count_lookups, ADMIT=admit, BLOCK=block,
        SCAN=max(16, min(1024, triton.next_power_of_2(n_blocks))), **consts)


def place_commit_triton(keys, uniq, counts, n_uniq, loc_u, bmiss, order, pool, counters, slot_ids, slot_freq,
                        slot_last_use, dirty, hit_mark, host_freq, move, stats, stat_index, used, clock: int,
                        train: bool) -> None:
    U = uniq.numel()
    block = place_block(U, uniq.device)
    consts = _stat_constexprs(stat_index, [("EVICT", "evictions"), ("IN", "rows_in"), ("OUT", "rows_out"),
                                           ("HOST", "host_rows")])
    place_commit_kernel[(triton.cdiv(U, block),)](
        keys, uniq, counts, n_uniq, loc_u, bmiss, order, pool, counters, slot_ids, slot_freq, slot_last_use,
        dirty.view(torch.uint8), hit_mark.view(torch.uint8), host_freq, *move, stats, used, U, clock,
        keys.numel() - 1, TRAIN=train, MAX_P=MAX_PROBE, BLOCK=block, num_warps=8 if block >= 256 else 4, **consts)


def place_lookup(keys, uniq, counts, n_uniq, protected, hit_mark, loc_u, bmiss, counters, stats, stat_index, used,
                 n_protected, limit: int, count_lookups: bool, admit: bool = True) -> None:
    """`admit=False`: no miss is admitted (n_admit = 0, no rebuild): a batch known to be all hits (a prefetch
    window's), whose misses, should the promise fail, are served from the host."""
    fn = place_lookup_triton if backend_for(uniq.device) == "triton" else place_lookup_torch
    with on_device(uniq):
        return fn(keys, uniq, counts, n_uniq, protected, hit_mark, loc_u, bmiss, counters, stats, stat_index, used,
                  n_protected, limit, count_lookups, admit)


def place_commit(keys, uniq, counts, n_uniq, loc_u, bmiss, order, pool, counters, slot_ids, slot_freq, slot_last_use,
                 dirty, hit_mark, host_freq, move, stats, stat_index, used, clock: int, train: bool) -> None:
    if backend_for(uniq.device) == "triton":
        with on_device(uniq):
            return place_commit_triton(keys, uniq, counts, n_uniq, loc_u, bmiss, order, pool, counters, slot_ids,
                                       slot_freq, slot_last_use, dirty, hit_mark, host_freq, move, stats, stat_index,
                                       used, clock, train)
    return place_commit_torch(keys, uniq, counts, n_uniq, loc_u, bmiss, order, pool, counters, slot_ids, slot_freq,
                              slot_last_use, dirty, hit_mark, host_freq, move, stats, stat_index, used, clock, train)
