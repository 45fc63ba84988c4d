/* The file tier's host id -> slab row index (cachedemb/storage/row_index.py), one pass per id in C. Loaded with
 * ctypes, which releases the GIL for each call. Same layout as kernels/id_index.py (whose torch code is the
 * reference): keys[H], H a power of two, EMPTY -1 / TOMB -2 / id << 30 | row; home = murmur3 fmix64(id) & (H-1);
 * linear probing; a lookup walks to the id or an EMPTY, an insert takes the first free position within
 * MAX_PROBE of home, a delete leaves TOMB.
 */
#include <stdint.h>

#define EMPTY (-1)
#define TOMB (-2)
#define SLOT_BITS 30
#define SLOT_MASK ((((int64_t)1) << SLOT_BITS) - 1)

static inline int64_t home(int64_t id, int64_t mask) {
    uint64_t x = (uint64_t)id;
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return (int64_t)(x & (uint64_t)mask);
}

static inline int64_t position(const int64_t *keys, int64_t mask, int64_t id) {
    int64_t p = home(id, mask);
    for (int64_t walked = 0; walked <= mask; walked++, p = (p + 1) & mask) {
        int64_t k = keys[p];
        if (k == EMPTY) return -1;
        if (k >= 0 && (k >> SLOT_BITS) == id) return p;
    }
    return -1;
}

/* out[i]: the row of ids[i], -1 where absent (or ids[i] < 0). */
void cemb_ri_lookup(const int64_t *keys, int64_t mask, const int64_t *ids, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t p = ids[i] >= 0 ? position(keys, mask, ids[i]) : -1;
        out[i] = p >= 0 ? (keys[p] & SLOT_MASK) : -1;
    }
}

/* Insert distinct absent (id, row) pairs; ok[i] 1 where placed within max_probe of home (0: not placed, or
 * ids[i] < 0). Returns the EMPTY positions claimed. */
int64_t cemb_ri_insert(int64_t *keys, int64_t mask, const int64_t *ids, const int64_t *rows, int64_t n,
                       int64_t max_probe, uint8_t *ok) {
    int64_t claimed = 0;
    for (int64_t i = 0; i < n; i++) {
        ok[i] = 0;
        if (ids[i] < 0) continue;
        int64_t p = home(ids[i], mask);
        for (int64_t d = 0; d < max_probe && d <= mask; d++, p = (p + 1) & mask) {
            if (keys[p] < 0) {
                claimed += keys[p] == EMPTY;
                keys[p] = (ids[i] << SLOT_BITS) | rows[i];
                ok[i] = 1;
                break;
            }
        }
    }
    return claimed;
}

/* Tombstone ids (negative or absent ids are skipped). */
void cemb_ri_delete(int64_t *keys, int64_t mask, const int64_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t p = ids[i] >= 0 ? position(keys, mask, ids[i]) : -1;
        if (p >= 0) keys[p] = TOMB;
    }
}

/* Lay out (id, row) pairs afresh: every position EMPTY, then each id (distinct, >= 0) at the first EMPTY of its
 * chain, however far (a lookup walks a chain to its end). The caller keeps the load well below 1. */
void cemb_ri_build(int64_t *keys, int64_t mask, const int64_t *ids, const int64_t *rows, int64_t n) {
    for (int64_t p = 0; p <= mask; p++) keys[p] = EMPTY;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0) continue;
        int64_t p = home(ids[i], mask);
        while (keys[p] != EMPTY) p = (p + 1) & mask;
        keys[p] = (ids[i] << SLOT_BITS) | rows[i];
    }
}
