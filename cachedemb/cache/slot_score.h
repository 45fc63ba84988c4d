/* One slot's score under a built-in eviction policy, bit for bit what cachedemb/cache/policy.py's lfu / lru /
 * lookahead and _finish compute (one table: no table rank); shared by score_native.c (scores of any slots) and
 * pool_native.c (the victim pool re-scored). kind: kernels/slot_score.py's SCORE_LFU 0, SCORE_LRU 1,
 * SCORE_LOOKAHEAD 2. An empty slot scores below every full one; a protected one PROTECTED. */
#ifndef CEMB_SLOT_SCORE_H
#define CEMB_SLOT_SCORE_H
#include <stdint.h>

#define CEMB_TIER (((int64_t)1) << 32)
#define CEMB_PROTECTED INT64_MAX

static inline int64_t cemb_min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline int64_t cemb_slot_score_of(int64_t kind, int64_t s, int64_t C, const int64_t *slot_ids,
                                         const int64_t *freq, const int64_t *last_use, const int64_t *next_use,
                                         uint8_t prot) {
    int64_t key;
    if (kind == 0) {
        key = cemb_min64(freq[s], 2 * CEMB_TIER - 1);
    } else if (kind == 1) {
        key = cemb_min64(last_use[s], 2 * CEMB_TIER - 1);
    } else {
        int64_t nu = next_use[s];
        if (nu < 0) {
            key = (int64_t)((uint64_t)cemb_min64(freq[s], (((int64_t)1) << 24) - 1) * 256u);
        } else {
            key = (2 * CEMB_TIER - 1) - cemb_min64(nu, CEMB_TIER - 1);
        }
    }
    int64_t score = (int64_t)((uint64_t)key * (uint64_t)C + (uint64_t)s);
    if (slot_ids[s] < 0) score = s - C;
    return prot ? CEMB_PROTECTED : score;
}
#endif
