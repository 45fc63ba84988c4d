/* The CPU cache's placement bookkeeping (EmbeddingCache._place on the host-count path), one pass per id in C:
 * cachedemb/cache/place_native.py. Each loop does what the torch code of _place does, in the same order, masked
 * scatters into the trailing "dump" element included, so the cache's state is the same bit for bit.
 */
#include <stdint.h>

#define HOST_LOC (-2)
#define AHEAD 16 /* the map entries (a random read in a table-sized array) prefetched ahead */

/* Hits and misses of distinct ids uniq[:cap] (the first n_uniq live) through the dense map id_slot; the hits'
 * slots are protected (prot[C] is the dump). Out: slot (-1: miss or dead), hit_slots (C: not a hit), was (the
 * protection before), counts = [hits, misses, hits newly protected]. */
void cemb_place_find(const int64_t *uniq, int64_t cap, int64_t n_uniq, const int32_t *id_slot, int64_t C,
                     uint8_t *prot, int64_t *slot, int64_t *hit_slots, uint8_t *was, int64_t *counts) {
    int64_t n_hit = 0, n_miss = 0, newly = 0;
    for (int64_t i = 0; i < cap; i++) {
        if (i + AHEAD < n_uniq && uniq[i + AHEAD] >= 0) __builtin_prefetch(&id_slot[uniq[i + AHEAD]], 0, 0);
        int64_t s = -1;
        if (i < n_uniq) s = (int64_t)id_slot[uniq[i] < 0 ? 0 : uniq[i]];
        int hit = i < n_uniq && s >= 0;
        n_hit += hit;
        n_miss += i < n_uniq && s < 0;
        slot[i] = s;
        hit_slots[i] = hit ? s : C;
        was[i] = prot[hit_slots[i]];
        newly += hit && !was[i];
    }
    for (int64_t i = 0; i < cap; i++) prot[hit_slots[i]] = 1;
    counts[0] = n_hit;
    counts[1] = n_miss;
    counts[2] = newly;
}

static void masked_put_i64(int64_t *target, const int64_t *index, const int64_t *values, int64_t fill, int64_t len,
                           int64_t n, int64_t dump) {
    for (int64_t j = 0; j < len; j++) {
        int64_t at = (j < n && index[j] >= 0) ? index[j] : dump;
        target[at] = values ? values[j] : fill;
    }
}

static void masked_put_u8(uint8_t *target, const int64_t *index, uint8_t fill, int64_t len, int64_t n, int64_t dump) {
    for (int64_t j = 0; j < len; j++) target[(j < n && index[j] >= 0) ? index[j] : dump] = fill;
}

/* After the victim choice: restore the protection, place the misses (rank r < n_admit takes victims[r], the rest
 * are served from the host), update the map and the slots' metadata. Out: loc_u [cap]; with k > 0 also
 * old_ids / dirty_ids [k], miss_ids / miss_dest [cap + 1] (the row moves), counts = [evicted, written]. */
void cemb_place_commit(const int64_t *uniq, int64_t cap, int64_t n_uniq, const int64_t *slot, const int64_t *hit_slots,
                       const uint8_t *was, uint8_t *prot, const int64_t *victims, int64_t k, int64_t n_admit,
                       int64_t n_miss, int64_t C, int32_t *id_slot, int64_t *slot_ids, uint8_t *dirty,
                       int64_t *last_use, int64_t batch, int64_t *loc_u, int64_t *dest, int64_t *old_ids,
                       int64_t *dirty_ids, int64_t *miss_ids, int64_t *miss_dest, int64_t *counts) {
    for (int64_t i = 0; i < cap; i++) prot[hit_slots[i]] = was[i];
    int64_t rank = -1;
    for (int64_t i = 0; i < cap; i++) {
        int live = i < n_uniq;
        int hit = live && slot[i] >= 0, miss = live && slot[i] < 0;
        rank += miss;
        int64_t d = -1;
        if (k > 0) {
            int64_t r = rank < 0 ? 0 : (rank > k - 1 ? k - 1 : rank);
            d = rank < n_admit ? victims[r] : HOST_LOC - uniq[i];
        }
        dest[i] = d;
        loc_u[i] = hit ? slot[i] : (miss ? d : -1);
    }
    counts[0] = counts[1] = 0;
    if (k <= 0) return;
    int64_t used = n_admit < k ? n_admit : k;
    for (int64_t j = 0; j < k; j++) old_ids[j] = slot_ids[victims[j]];
    for (int64_t j = 0; j < used; j++) {
        if (j + AHEAD < used && old_ids[j + AHEAD] >= 0) __builtin_prefetch(&id_slot[old_ids[j + AHEAD]], 1, 0);
        if (old_ids[j] >= 0) id_slot[old_ids[j]] = -1;
    }
    for (int64_t i = 0; i < cap && i < n_uniq; i++) {
        if (i + AHEAD < n_uniq && uniq[i + AHEAD] >= 0) __builtin_prefetch(&id_slot[uniq[i + AHEAD]], 1, 0);
        if (slot[i] < 0 && dest[i] >= 0) id_slot[uniq[i]] = (int32_t)dest[i];
    }
    for (int64_t r = 0; r <= cap; r++) miss_ids[r] = miss_dest[r] = -1;
    rank = -1;
    for (int64_t i = 0; i < cap; i++) {
        int miss = i < n_uniq && slot[i] < 0;
        rank += miss;
        int64_t at = miss ? rank : cap;
        miss_ids[at] = uniq[i];
        miss_dest[at] = dest[i] >= 0 ? dest[i] : -1;
    }
    for (int64_t j = 0; j < k; j++) {
        dirty_ids[j] = (dirty[victims[j]] && old_ids[j] >= 0) ? old_ids[j] : -1;
        if (j < n_admit) {
            counts[0] += old_ids[j] >= 0;
            counts[1] += dirty_ids[j] >= 0;
        }
    }
    masked_put_i64(slot_ids, victims, 0, -1, k, n_admit, C);
    masked_put_u8(dirty, victims, 0, k, n_admit, C);
    masked_put_i64(slot_ids, miss_dest, miss_ids, 0, cap + 1, n_miss, C);
    masked_put_u8(dirty, miss_dest, 0, cap + 1, n_miss, C);
    masked_put_i64(last_use, miss_dest, 0, batch, cap + 1, n_miss, C);
}

/* prepare's training counts (after the placement): a resident id (live, loc >= 0) adds its count to its slot and
 * stamps the slot's last use; every other id adds to and stamps the dump element (index_add_ / index_fill_ over
 * the dumped index); a live id served from the host (loc <= HOST_LOC) adds its count to its host row. Returns
 * the batch's real lookups (inverse >= 0). */
int64_t cemb_count_uses(const int64_t *loc_u, const uint8_t *live, const int64_t *counts, int64_t cap, int64_t dump,
                        int64_t batch, int64_t *slot_freq, int64_t *last_use, int64_t *host_freq, int64_t host_rows,
                        const int64_t *inverse, int64_t n_lookups, int64_t train) {
    if (train) {
        for (int64_t i = 0; i < cap; i++) {
            int64_t loc = loc_u[i];
            int64_t at = (live[i] && loc >= 0) ? loc : dump;
            slot_freq[at] += counts[i];
            last_use[at] = batch;
            if (live[i] && loc <= HOST_LOC) {
                int64_t row = HOST_LOC - loc;
                if (row < host_rows) host_freq[row] += counts[i];
            }
        }
    }
    int64_t lookups = 0;
    for (int64_t j = 0; j < n_lookups; j++) lookups += inverse[j] >= 0;
    return lookups;
}

/* A window's protection: prot[slot] = value for the slot of each location (those outside [0, C), host-served,
 * go to the dump element C, as _resident_or_dump sends them). Returns how many slots in [0, C) changed. */
int64_t cemb_set_protection(uint8_t *prot, const int64_t *loc, int64_t n, int64_t C, int64_t value) {
    int64_t changed = 0;
    uint8_t v = value ? 1 : 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n && loc[i + AHEAD] >= 0 && loc[i + AHEAD] < C) __builtin_prefetch(&prot[loc[i + AHEAD]], 1, 0);
        int64_t s = (loc[i] >= 0 && loc[i] < C) ? loc[i] : C;
        changed += s < C && prot[s] != v;
        prot[s] = v;
    }
    return changed;
}
