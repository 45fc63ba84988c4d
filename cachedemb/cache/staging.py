"""Staging slots: a cache's slots beyond its `cache_rows`, where a prefetch loop lands the next window's new rows
while the window in use computes, and the trim that brings the cache back to `cache_rows` resident rows at each
window's activation (docs/prefetch.md: the timeline, the sizing rule, what "the same cache_rows" means).

There are no fixed staging slots: after a trim at least `staging_rows` slots are empty, the next window's new rows
take empty slots first (they score below every occupied one), and the trim empties as many slots as the cache
holds rows beyond `cache_rows`, choosing by the policy among the rows no window in use needs.
"""
from __future__ import annotations

import torch

from cachedemb.cache.sync_mode import counts_on_host
from cachedemb.kernels import PROTECTED, id_index


def reserve(cache, rows: int) -> None:
    """Give `cache` at least `rows` staging slots beyond its `cache_rows`: every slot buffer (rows, optimizer
    state, slot metadata, index, masks, victim pool, next uses) is reallocated once, the resident rows kept in
    their slots; never shrunk, so a CUDA graph captured after it keeps its addresses. Outside any window
    (protection is dropped). Refused, before anything changes, for a bad `rows`."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise ValueError(f"staging_rows must be an int >= 0 (slots beyond the cache's rows), got {rows!r}")
    if rows <= cache.staging_rows:
        return
    old, new = cache.capacity, cache.cache_rows + rows
    if new > id_index.SLOT_MASK:
        raise ValueError(f"a cache of {cache.cache_rows} rows and {rows} staging rows passes the id index's "
                         f"{id_index.SLOT_MASK} slots")
    cache.settle()
    cache._drop_protection()
    rows_now = cache.rows.data[:old].clone()
    states_now = {name: state[:old].clone() for name, state in cache.states.items()}
    meta = {name: getattr(cache, name)[:old].clone() for name in ("slot_ids", "slot_freq", "slot_last_use", "dirty")}
    cache.capacity, cache.staging_rows = new, rows
    cache._allocate(new)  # the new slots empty; index, pool, masks and next uses afresh
    cache.rows[:old].copy_(rows_now)
    for name, state in states_now.items():
        cache.states[name][:old].copy_(state)
    for name, values in meta.items():
        getattr(cache, name)[:old].copy_(values)
    cache._rebuild_index()
    cache.generation += 1
    cache.slot_epoch += 1


def trim(cache, policy) -> None:
    """Evict `cache`'s lowest-scored unprotected rows until at most `cache_rows` are resident (at a prefetch
    window's activation, its rows protected, and at the loop's end): the choice a full cache of `cache_rows`
    makes for that window, made once the window before it is done. Dirty rows are written back in stream order
    (after the last backward). No host read under the CUDA rules: the excess is a device count, the candidates a
    fixed top-`staging_rows` of the scores, unused entries -1 for `drop_rows`."""
    if not cache.staging_rows:
        return
    c, s = cache.capacity, cache.staging_rows
    ids = cache.slot_ids[:c]
    occupied = ids >= 0
    excess = (occupied.sum() - cache.cache_rows).clamp(min=0, max=s)
    if counts_on_host(cache.device) and int(excess) == 0:
        return
    score = cache._score_all(policy, cache.protected[:c], None)
    score = torch.where(occupied, score, torch.full_like(score, PROTECTED))  # empty slots hold nothing to evict
    order = torch.topk(score, s, largest=False, sorted=True).indices
    chosen = (torch.arange(s, device=cache.device) < excess) & (score.index_select(0, order) < PROTECTED)
    cache.drop_rows(torch.where(chosen, ids.index_select(0, order), torch.full_like(order, -1)))
    if not counts_on_host(cache.device):
        cache.victim_pool.invalidate()  # the emptied slots score below the pool's bound
