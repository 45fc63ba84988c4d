/* The host cache's eviction candidates and their keys in one pass over the slab (cachedemb/storage/slab_victims.py),
 * loaded with ctypes (no GIL). A candidate is a cached row (row_id >= 0) no batch in flight holds
 * (row_step < done_below) and not in `keep`; its key orders victims: (count capped at 2^40 - 1) << 22 |
 * (last batch + 1, clipped to [0, 2^22 - 1]) | (read by a batch of the horizon) << 62, the numpy code's bits. */
#include <stdint.h>

int64_t cemb_slab_victim_keys(const int64_t *row_id, const int64_t *row_step, const int64_t *next_use,
                              const int64_t *freq, int64_t n, int64_t done_below, const int64_t *keep, int64_t n_keep,
                              uint8_t *scratch, int64_t *cand, int64_t *key) {
    for (int64_t j = 0; j < n_keep; j++)
        if (keep[j] >= 0 && keep[j] < n) scratch[keep[j]] = 1;
    int64_t c = 0;
    const int64_t fmax = ((int64_t)1 << 40) - 1, smax = ((int64_t)1 << 22) - 1;
    for (int64_t r = 0; r < n; r++) {
        if (row_id[r] < 0 || row_step[r] >= done_below || scratch[r]) continue;
        int64_t f = freq[r] < fmax ? freq[r] : fmax;
        int64_t s = row_step[r] + 1;
        s = s < 0 ? 0 : (s > smax ? smax : s);
        uint64_t k = ((uint64_t)f << 22) | (uint64_t)s;
        if (next_use[r] >= done_below) k |= (uint64_t)1 << 62;
        cand[c] = r;
        key[c] = (int64_t)k;
        c++;
    }
    for (int64_t j = 0; j < n_keep; j++)
        if (keep[j] >= 0 && keep[j] < n) scratch[keep[j]] = 0;
    return c;
}
