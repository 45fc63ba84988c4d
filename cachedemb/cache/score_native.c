/* The built-in eviction policies' slot scores on CPU (cachedemb/cache/score_native.py), one pass in C: what
 * cachedemb/cache/policy.py's lfu / lru / lookahead and _finish compute with ~10 torch ops (and the view's
 * gathers), bit for bit. Entry i scores slot s = slots ? slots[i] : i from that slot's metadata; prot[i] is the
 * entry's protection. kind: kernels/slot_score.py's SCORE_LFU 0, SCORE_LRU 1, SCORE_LOOKAHEAD 2 (one table:
 * no table rank). */
#include "slot_score.h"

void cemb_slot_score(int64_t kind, const int64_t *slots, int64_t n, int64_t C, const int64_t *slot_ids,
                     const int64_t *freq, const int64_t *last_use, const int64_t *next_use, const uint8_t *prot,
                     int64_t *out) {
    for (int64_t i = 0; i < n; i++)
        out[i] = cemb_slot_score_of(kind, slots ? slots[i] : i, C, slot_ids, freq, last_use, next_use, prot[i]);
}

/* The look-ahead's input from a read-ahead snapshot (EmbeddingCache._set_next_use): each slot's batches to its
 * next use (`uses`, counted from the window's start), -1 where none is known or the slot's id changed since the
 * snapshot `ids`. */
void cemb_next_use(const int64_t *slot_ids, const int64_t *ids, const int64_t *uses, int64_t n, int64_t *out) {
    for (int64_t s = 0; s < n; s++) out[s] = (slot_ids[s] == ids[s] && uses[s] >= 0) ? uses[s] : -1;
}
