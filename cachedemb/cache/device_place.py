"""A batch's placement under the CUDA rules: a fixed sequence of fused launches, no host read, no Python loop over
ids (the host-count path, CPU outside the sync-free mode, stays in embedding_cache.py).

launch (count): what it does
- `torch.zeros`, `torch.empty` (2): the batch's counters and its int64 buffers, one allocation each
- `torch.sort` + 2 kernels (`unique_ids`): distinct ids, inverse, counts, the lookups grouped by id
- `place_lookup` (1): index lookup; hits marked (protected for the batch); counts; miss ranks; rebuild decision
- `index_rebuild` (2, gated): clear the index and re-insert the resident ids, when it could pass its load limit
- `pool_rank` (8 + `torch.sort`): the pool checked; the whole cache ranked (6 radix passes, a compaction) only
  when the pool cannot serve the batch; the pool in ascending score
- `place_commit` (1): victims out of the index, misses in (compare-and-swap), slot metadata, counts of hits and
  host-served misses, the row moves recorded
- `row_move` (1, by the cache): dirty victims' rows, state and counts to the host, the misses' rows in (a
  window's later, in `transfer_window`)

Same results as the host-count path: the same victims in the same order, the same rows in the same slots; only
the id index's layout may differ (it depends on the order the GPU runs the inserts in; every lookup answers the
same). The torch backend runs the same sequence on each op's reference.
"""
from __future__ import annotations

import time

import torch

from cachedemb import kernels
from cachedemb.kernels import id_index, place, slot_rank
from cachedemb.kernels.unique_ids import unique_buffers
from cachedemb.cache.policy import Policy, score_kernel


class BatchBuffers:
    """The int64 buffers of one batch of B lookups in two allocations (one zeroed for the device counters)."""

    def __init__(self, B: int, cap: int, device: torch.device, with_unique: bool):
        U = B
        self.U = U
        u_out, u_aux = unique_buffers(B, device) if with_unique else (0, 0)
        n_bmiss = place.bmiss_size(U, device)
        sizes = [("unique", u_out), ("loc_u", U), ("bmiss", n_bmiss), ("sortbuf", cap),
                 ("bag", B if with_unique else 0)] + \
                [(name, U) for name in ("victims", "old_ids", "dirty_ids", "miss_ids", "miss_dest", "add")]
        total = sum(n for _, n in sizes)
        flat = torch.empty(max(total, 1), dtype=torch.int64, device=device)
        at = 0
        for name, n in sizes:
            setattr(self, name, flat[at:at + n])
            at += n
        zeros = torch.zeros(u_aux + place.N_COUNTERS + slot_rank.AUX_SIZE, dtype=torch.int64, device=device)
        self.unique_aux = zeros[:u_aux]
        self.counters = zeros[u_aux:u_aux + place.N_COUNTERS]
        self.rank_aux = zeros[u_aux + place.N_COUNTERS:]

    def move(self):
        return (self.victims, self.old_ids, self.dirty_ids, self.miss_ids, self.miss_dest, self.add)


def unique(cache, ids: torch.Tensor, padding_idx, bufs: BatchBuffers):
    """unique_ids into the batch's buffers (the Triton path; the reference allocates its own)."""
    return kernels.unique_ids(ids, padding_idx, return_groups=True, buffers=(bufs.unique, bufs.unique_aux))


def place_batch(cache, uniq, n_uniq, policy: Policy, bufs: BatchBuffers, sizes, counts=None, train: bool = False,
                count_lookups: bool = False, admit: bool = True):
    """Find or admit the first n_uniq ids of `uniq` ([U]); returns (loc_u, n_hit, n_miss, move), `move` the
    RowMove's fields (victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest, n_miss): the caller moves the
    rows (adding bufs.add to the admitted counts with `train`). Same contract as EmbeddingCache._place;
    `sizes` = pool.device_sizes(policy, U) (taken before `bufs` were sized by it);
    `counts` (the batch's lookups per id) and `train` bump counts and recency (hits and admitted rows in the
    cache, host-served rows on the host), `count_lookups` the lookup statistics. `admit=False` (a batch of a
    prefetch window, all hits): no victim is chosen and no row moves (misses, should there be any, are served
    from the host): lookup and commit only."""
    C = cache.capacity
    U = uniq.numel()
    counters = bufs.counters
    cache._use_hash()
    counts = counts if counts is not None else uniq
    stat_index = cache.stat_index
    kernels.place_lookup(cache.index_keys, uniq, counts, n_uniq, cache.protected, cache.hit_mark, bufs.loc_u,
                         bufs.bmiss, counters, cache.stats, stat_index, cache.index_used, cache._n_protected,
                         cache._index_limit, count_lookups, admit)
    n_hit = counters[place.N_HIT:place.N_HIT + 1]
    n_miss = counters[place.N_MISS:place.N_MISS + 1]
    n_admit = counters[place.N_ADMIT:place.N_ADMIT + 1]
    move = (bufs.victims, n_admit, bufs.old_ids, bufs.dirty_ids, bufs.miss_ids, bufs.miss_dest, n_miss)
    if not admit:
        kernels.place_commit(cache.index_keys, uniq, counts, n_uniq, bufs.loc_u, bufs.bmiss, bufs.loc_u,
                             bufs.loc_u, counters, cache.slot_ids, cache.slot_freq, cache.slot_last_use, cache.dirty,
                             cache.hit_mark, cache.host_freq, bufs.move(), cache.stats, stat_index, cache.index_used,
                             cache.batch_counter, train)
        return bufs.loc_u, n_hit, n_miss, move
    id_index.index_rebuild(cache.index_keys, cache.slot_ids[:C], counters[place.REBUILD:place.REBUILD + 1],
                           cache.index_used)
    pool = cache.victim_pool
    size, cap, stale = sizes
    kind = score_kernel(policy) if kernels.backend_for(cache.device) == "triton" else None

    def score_fn(slots, protected):
        return policy(cache._slot_view(slots, protected))

    tables = None if cache.table_starts is None else (cache.table_starts, cache.table_ranks)
    sortbuf = bufs.sortbuf[:cap]
    rank_start = time.perf_counter()
    order = kernels.pool_rank(kind, score_fn, cache.slot_ids, cache.slot_freq, cache.slot_last_use, cache.next_use,
                              cache.protected, cache.hit_mark, tables, pool.device_slots, pool.state,
                              pool.device_score, sortbuf, counters, bufs.rank_aux, size, stale)
    cache.seconds["victim_rank"] += time.perf_counter() - rank_start  # the pool check and the gated ranking
    pool.observe(counters[place.N_HIT:place.N_MISS + 1])  # (hits too: the module's too-small-cache warning)
    kernels.place_commit(cache.index_keys, uniq, counts, n_uniq, bufs.loc_u, bufs.bmiss, order, pool.device_slots,
                         counters, cache.slot_ids, cache.slot_freq, cache.slot_last_use, cache.dirty, cache.hit_mark,
                         cache.host_freq, bufs.move(), cache.stats, stat_index, cache.index_used, cache.batch_counter,
                         train)
    return bufs.loc_u, n_hit, n_miss, move


def batch(cache, policy: Policy, B: int, with_unique: bool, admit: bool = True):
    """(pool sizes, buffers) for a batch of B lookups (or a window of B distinct ids); no pool sizes (nor sort
    buffer) for a batch that admits nothing."""
    sizes = cache.victim_pool.device_sizes(policy, B) if admit else None
    return sizes, BatchBuffers(B, max(sizes[1], 1) if admit else 0, cache.device, with_unique)
