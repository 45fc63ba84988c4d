/* The victim pool's bookkeeping (cachedemb/cache/victim_pool.py) in passes over the pool and the slots that join
 * it, not over the cache: loaded with ctypes by pool_native.py. */
#include "slot_score.h"

/* out = pool, then each slot of `slots` in [0, C) that is in neither (first occurrence, in order), marked in
 * `mark` (C bytes); returns the union's size. */
static int64_t union_marked(const int64_t *pool, int64_t P, const int64_t *slots, int64_t W, int64_t C,
                            uint8_t *mark, int64_t *out) {
    for (int64_t i = 0; i < P; i++) {
        mark[pool[i]] = 1;
        out[i] = pool[i];
    }
    int64_t n = P;
    for (int64_t j = 0; j < W; j++) {
        int64_t s = slots[j];
        if (s < 0 || s >= C || mark[s]) continue;
        mark[s] = 1;
        out[n++] = s;
    }
    return n;
}

/* The union above; `mark` is all 0 on entry and on return. */
int64_t cemb_pool_union(const int64_t *pool, int64_t P, const int64_t *slots, int64_t W, int64_t C, uint8_t *mark,
                        int64_t *out) {
    int64_t n = union_marked(pool, P, slots, W, C, mark, out);
    for (int64_t i = 0; i < n; i++) mark[out[i]] = 0;
    return n;
}

/* A choice's re-scoring of the pool joined by `slots` (VictimPool.choose, exact path) in one pass: the union
 * (`uni`, as cemb_pool_union) and each entry's score under its slot's protection prot[s] (`score`); the entries
 * that stay in the pool after the choice (`kept`, `kept_score`: score <= bound, or PROTECTED unless `drop_prot`,
 * in union order); counts = [union size, kept size, valid entries (score <= bound and not PROTECTED)]. `mark` as
 * above. A protected entry's score is PROTECTED without reading its slot's metadata. */
void cemb_pool_rescore(int64_t kind, const int64_t *pool, int64_t P, const int64_t *slots, int64_t W, int64_t C,
                       const int64_t *slot_ids, const int64_t *freq, const int64_t *last_use,
                       const int64_t *next_use, const uint8_t *prot, int64_t bound, int64_t drop_prot,
                       uint8_t *mark, int64_t *uni, int64_t *score, int64_t *kept, int64_t *kept_score,
                       int64_t *counts) {
    int64_t n = union_marked(pool, P, slots, W, C, mark, uni);
    int64_t m = 0, valid = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = uni[i];
        mark[s] = 0;
        int64_t v = prot[s] ? CEMB_PROTECTED : cemb_slot_score_of(kind, s, C, slot_ids, freq, last_use, next_use, 0);
        score[i] = v;
        if (v <= bound || (v == CEMB_PROTECTED && !drop_prot)) {
            kept[m] = s;
            kept_score[m++] = v;
            valid += v != CEMB_PROTECTED;
        }
    }
    counts[0] = n;
    counts[1] = m;
    counts[2] = valid;
}
