/* The built-in eviction policies' slot scores on CPU (cachedemb/cache/score_native.py), one pass in C: what
 * cachedemb/cache/policy.py's lfu / lru / lookahead and _finish compute with ~10 torch ops (and the view's
 * gathers), bit for bit. Entry i scores slot s = slots ? slots[i] : i from that slot's metadata; prot[i] is the
 * entry's protection. kind: kernels/slot_score.py's SCORE_LFU 0, SCORE_LRU 1, SCORE_LOOKAHEAD 2 (one table:
 * no table rank). */
#include <stdint.h>

#define TIER (((int64_t)1) << 32)
#define PROTECTED INT64_MAX

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

void cemb_slot_score(int64_t kind, const int64_t *slots, int64_t n, int64_t C, const int64_t *slot_ids,
                     const int64_t *freq, const int64_t *last_use, const int64_t *next_use, const uint8_t *prot,
                     int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t s = slots ? slots[i] : i;
        int64_t key;
        if (kind == 0) {
            key = min64(freq[s], 2 * TIER - 1);
        } else if (kind == 1) {
            key = min64(last_use[s], 2 * TIER - 1);
        } else {
            int64_t nu = next_use[s];
            if (nu < 0) {
                key = (int64_t)((uint64_t)min64(freq[s], (((int64_t)1) << 24) - 1) * 256u);
            } else {
                key = (2 * TIER - 1) - min64(nu, TIER - 1);
            }
        }
        int64_t score = (int64_t)((uint64_t)key * (uint64_t)C + (uint64_t)s);
        if (slot_ids[s] < 0) score = s - C;
        out[i] = prot[i] ? PROTECTED : score;
    }
}

/* The look-ahead's input from a read-ahead snapshot (EmbeddingCache._set_next_use): batches from `now` to each
 * slot's next use, -1 where none is known or the slot's id changed since the snapshot. */
void cemb_next_use(const int64_t *slot_ids, const int64_t *ids, const int64_t *uses, int64_t n, int64_t now,
                   int64_t *out) {
    for (int64_t s = 0; s < n; s++) out[s] = (slot_ids[s] == ids[s] && uses[s] >= now) ? uses[s] - now : -1;
}
