/* The victim pool's set union (cachedemb/cache/victim_pool.py `include`) in one pass over the pool and the new
 * slots, not over the cache: loaded with ctypes by pool_native.py. */
#include <stdint.h>

/* out = pool, then each slot of `slots` in [0, C) that is in neither (first occurrence, in order); `mark` is C
 * bytes, all 0 on entry and on return. Returns the union's size. */
int64_t cemb_pool_union(const int64_t *pool, int64_t P, const int64_t *slots, int64_t W, int64_t C, uint8_t *mark,
                        int64_t *out) {
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
    for (int64_t i = 0; i < n; i++) mark[out[i]] = 0;
    return n;
}
