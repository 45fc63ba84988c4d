"""What the cache's counters and timers are called in `cache_stats()`: the readable names of the internal timers,
the reported hits and misses (a window's admitted rows as misses), and the hit rate."""
from __future__ import annotations

#: `cache_stats()["seconds"]`: each internal timer (`EmbeddingCache.seconds`) under a readable name. An entry
#: includes the ones its work calls: `lookup` the `eviction`, `index_rebuild` and `count_halving` of batches,
#: `prefetch.window_admission` its window's `eviction` and `next_use_refresh`.
SECONDS = {
    "lookup": "prepare",  # a forward's cache work: ids looked up, misses admitted (victims, row moves issued)
    "eviction": "victim_rank",  # ranking slots for victims (the victim pool's check and its full rankings)
    "index_rebuild": "index_rebuild",  # clearing the id index's tombstones (O(cache), rare)
    "count_halving": "halve_counts",  # freq_halflife: every access count halved
    "flush": "flush",  # dirty rows written back to the host table (m.weight, state_dict, checkpoints)
    "prefetch": {
        "read": "prefetch_read",  # the training thread reading batches and extracting their ids
        "wait": "prefetch_wait",  # the training thread waiting for the read-ahead thread
        "window_admission": "admit_window",  # planning a window: victims, slot metadata, index
        "next_use_refresh": "next_use_refresh",  # the look-ahead policy's next uses set for a window
        "window_protect": "window_protect",  # protecting a window's slots as it starts
        "row_moves_wait": "transfer_wait",  # waiting for a window's row copies (CPU: a host thread's)
        "read_ahead": {  # on the read-ahead thread, beside the step
            "unique": "prefetch_unique",  # each batch's distinct ids
            "next_use": "prefetch_next_use",  # the id horizon's use bits updated
            "window_plan": "prefetch_window_plan",  # window depth and union
            "next_use_query": "prefetch_next_use_query",  # next uses of the resident ids for a window
            "forward_unique": "prefetch_forward_unique",  # the forward's unique ids, handed over
        },
    },
}


def named_seconds(layout: dict, seconds: dict[str, float]) -> dict:
    return {name: named_seconds(key, seconds) if isinstance(key, dict) else seconds[key]
            for name, key in layout.items()}


def window_rows_as_misses(values: dict) -> dict:
    """Raw counters -> reported: a window's admitted rows move from `hits` to `misses` at their first lookup."""
    values["hits"] = values["hits"] - values["window_misses"]
    values["misses"] = values["misses"] + values["window_misses"]
    return values


def hit_rate(hits: int, unique: int) -> float:
    """hits / unique (nan before any lookup)."""
    return hits / unique if unique else float("nan")
