/* A read-ahead batch's unique slab rows in the form the inner forward's unique_ids returns them
 * (cachedemb/storage/inner_unique.py), from the sort of its table ids: loaded with ctypes (no GIL). Distinct id j
 * sits in slab row rows[j]; order sorts the rows ascending. Unique position k holds row rows[order[k]]; its
 * lookups are id order[k]'s run of the id sort (s_perm[start .. start + counts)), already in lookup order. */
#include <stdint.h>
#include <string.h>

void cemb_inner_unique(const int64_t *order, const int64_t *rows, const int64_t *inverse, const int64_t *s_perm,
                      const int64_t *counts, int64_t n, int64_t B, int64_t *scratch, int64_t *uniq,
                      int64_t *inv_out, int64_t *cnt_out, int64_t *perm_out, int64_t *ptr) {
    int64_t *rank = scratch, *start = scratch + n;
    int64_t s = 0;
    for (int64_t j = 0; j < n; j++) {
        start[j] = s;
        s += counts[j];
    }
    int64_t q = 0;
    ptr[0] = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t j = order[k], c = counts[j];
        rank[j] = k;
        uniq[k] = rows[j];
        cnt_out[k] = c;
        memcpy(perm_out + q, s_perm + start[j], (size_t)c * sizeof(int64_t));
        q += c;
        ptr[k + 1] = q;
    }
    for (int64_t k = n; k < B; k++) {
        uniq[k] = -1;
        cnt_out[k] = 0;
        ptr[k + 1] = q;
    }
    for (int64_t i = 0; i < B; i++)
        inv_out[i] = rank[inverse[i]];
}
