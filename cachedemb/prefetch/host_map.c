/* The look-ahead's host id map (cachedemb/prefetch/id_map.py) and use bits (next_use.py), one pass per id in C.
 * Loaded with ctypes, which releases the GIL for each call, so the read-ahead thread runs beside the step. The
 * torch code in those files is the reference: same map layout rules (linear probing from the multiplicative
 * hash's top bits, EMPTY -1 / TOMB -2, a tail before the always-EMPTY last position), same answers.
 */
#include <stdint.h>

#define EMPTY (-1)
#define TOMB (-2)
#define MULT ((uint64_t)0x9E3779B97F4A7C15ULL)
#define AHEAD 16 /* entries prefetched ahead: every loop below reads the map at random positions */

static inline int64_t home(int64_t id, int64_t bits) {
    int64_t prod = (int64_t)((uint64_t)id * MULT);
    return (prod >> (64 - bits)) & (((int64_t)1 << bits) - 1);
}

/* out[i]: the position of ids[i], -1 where absent. */
void cemb_map_find(const int64_t *keys, int64_t bits, const int64_t *ids, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&keys[home(ids[i + AHEAD], bits)], 0, 0);
        int64_t id = ids[i], p = home(id, bits), found = -1;
        for (;; p++) {
            int64_t k = keys[p];
            if (k == id) { found = p; break; }
            if (k == EMPTY) break;
        }
        out[i] = found;
    }
}

/* Insert distinct absent ids at the first free (EMPTY or TOMB) position of their probe; out[i] its position.
 * Returns the TOMBs reused, or -1 (the map unchanged) if a probe would reach position `none`. */
int64_t cemb_map_insert(int64_t *keys, int64_t bits, int64_t none, const int64_t *ids, int64_t n, int64_t *out,
                        int64_t *was) {
    int64_t reused = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&keys[home(ids[i + AHEAD], bits)], 1, 0);
        int64_t p = home(ids[i], bits);
        while (keys[p] >= 0) p++;
        if (p >= none) {
            for (int64_t j = i - 1; j >= 0; j--) keys[out[j]] = was[j];
            return -1;
        }
        was[i] = keys[p];
        reused += keys[p] == TOMB;
        keys[p] = ids[i];
        out[i] = p;
    }
    return reused;
}

/* The ids at `pos` whose W words are all zero leave the map (TOMB), unless pinned. A TOMB followed by an EMPTY
 * position ends no probe that an EMPTY would not end there too, so it becomes EMPTY, and so do the TOMBs right
 * before it: a map whose ids come and go keeps its positions EMPTY instead of filling with TOMBs until a relayout.
 * Returns the positions made EMPTY (the map's `used` drops by as many). */
int64_t cemb_map_drop_empty(int64_t *keys, const int64_t *words, const uint8_t *pinned, int64_t W, const int64_t *pos,
                            int64_t n) {
    int64_t freed = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = pos[i], any = 0;
        if (keys[p] < 0) continue;
        for (int64_t w = 0; w < W; w++) any |= words[p * W + w];
        if (any || pinned[p]) continue;
        keys[p] = TOMB;
        if (keys[p + 1] != EMPTY) continue;  /* p + 1 exists: the last position is always EMPTY */
        for (int64_t q = p; q >= 0 && keys[q] == TOMB; q--) {
            keys[q] = EMPTY;
            freed++;
        }
    }
    return freed;
}

/* words[pos[i], word] |= bit (set) or &= ~bit (clear, then drop the ids left with no word, unless pinned). */
void cemb_bits_set(int64_t *words, int64_t W, int64_t word, int64_t bit, const int64_t *pos, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&words[pos[i + AHEAD] * W + word], 1, 0);
        words[pos[i] * W + word] |= bit;
    }
}

int64_t cemb_bits_clear_drop(int64_t *keys, int64_t *words, const uint8_t *pinned, int64_t W, int64_t word,
                             int64_t bit, const int64_t *pos, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&words[pos[i + AHEAD] * W + word], 1, 0);
        words[pos[i] * W + word] &= ~bit;
    }
    return cemb_map_drop_empty(keys, words, pinned, W, pos, n);
}

/* out[i]: the first batch whose bit is set in the words at pos[i], over segments s in batch order (word
 * seg_word[s], bits seg_mask[s], the batch of bit 0 seg_base[s]); -1: none. */
void cemb_first_in(const int64_t *words, int64_t W, const int64_t *pos, int64_t n, const int64_t *seg_word,
                   const int64_t *seg_mask, const int64_t *seg_base, int64_t nseg, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&words[pos[i + AHEAD] * W], 0, 0);
        int64_t p = pos[i], first = -1;
        for (int64_t s = 0; s < nseg; s++) {
            uint64_t v = (uint64_t)(words[p * W + seg_word[s]] & seg_mask[s]);
            if (v) { first = seg_base[s] + __builtin_ctzll(v); break; }
        }
        out[i] = first;
    }
}

/* The indices i (ascending) whose words at pos[i] have no bit in any segment: written to out, counted; stops
 * as soon as the count passes `budget` and returns -1 (a window planner that only needs to know the batch
 * does not fit reads a few thousand ids, not the batch's 40k). */
int64_t cemb_unused_in(const int64_t *words, int64_t W, const int64_t *pos, int64_t n, const int64_t *seg_word,
                       const int64_t *seg_mask, int64_t nseg, int64_t budget, int64_t *out) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&words[pos[i + AHEAD] * W], 0, 0);
        int64_t p = pos[i], used = 0;
        for (int64_t s = 0; s < nseg && !used; s++) used = (words[p * W + seg_word[s]] & seg_mask[s]) != 0;
        if (!used) {
            if (count >= budget) return -1;
            out[count++] = i;
        }
    }
    return count;
}

/* a[pos[i]] = value (pins: a bool array as bytes; the slot-at array). */
void cemb_fill_u8(uint8_t *a, const int64_t *pos, int64_t n, int64_t value) {
    for (int64_t i = 0; i < n; i++) a[pos[i]] = (uint8_t)value;
}

void cemb_fill_i64(int64_t *a, const int64_t *pos, int64_t n, int64_t value) {
    for (int64_t i = 0; i < n; i++) a[pos[i]] = value;
}

/* slot_at[pos[changed[i]]] = changed[i] for the changed slots with a position (not `none`); returns 0 where a
 * position was taken already (by another slot, or by two changed ones), else 1. */
int64_t cemb_track_slots(int64_t *slot_at, const int64_t *pos, const int64_t *changed, int64_t n, int64_t none) {
    int64_t ok = 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = pos[changed[i]];
        if (p == none) continue;
        if (slot_at[p] >= 0) ok = 0;
        slot_at[p] = changed[i];
    }
    for (int64_t i = 0; i < n && ok; i++) {
        int64_t p = pos[changed[i]];
        if (p != none && slot_at[p] != changed[i]) ok = 0;
    }
    return ok;
}

static inline int64_t first_set(const int64_t *row, const int64_t *seg_word, const int64_t *seg_mask,
                                const int64_t *seg_base, int64_t nseg) {
    for (int64_t s = 0; s < nseg; s++) {
        uint64_t v = (uint64_t)(row[seg_word[s]] & seg_mask[s]);
        if (v) return seg_base[s] + __builtin_ctzll(v);
    }
    return -1;
}

/* One step of moving the slots' kept first uses on (next_use.py's `_slide`). For each entry of `list` (a slot
 * when via_slot_at is 0; else a map position, whose slot is slot_at[p], skipped where -1) whose kept use passes
 * the test (when 0: always; 1: uses[s] < lo, its first use left the range; 2: uses[s] == -1, none in the last
 * range), uses[s] becomes the first batch set in the words at pos[s] over the segments. Recomputing a slot
 * twice gives the same answer, so the order of the entries does not change the result. */
void cemb_slide_pass(const int64_t *words, int64_t W, const int64_t *pos, int64_t *uses, const int64_t *slot_at,
                     const int64_t *list, int64_t n, int64_t via_slot_at, int64_t test, int64_t lo,
                     const int64_t *seg_word, const int64_t *seg_mask, const int64_t *seg_base, int64_t nseg) {
    /* three random reads a slot (slot_at, then uses and pos, then its words): prefetched in stages, each AHEAD
     * entries before the next reads it */
    for (int64_t i = 0; i < n; i++) {
        if (via_slot_at && i + 3 * AHEAD < n) __builtin_prefetch(&slot_at[list[i + 3 * AHEAD]], 0, 0);
        if (i + 2 * AHEAD < n) {
            int64_t t = via_slot_at ? slot_at[list[i + 2 * AHEAD]] : list[i + 2 * AHEAD];
            if (t >= 0) { __builtin_prefetch(&uses[t], 0, 0); __builtin_prefetch(&pos[t], 0, 0); }
        }
        if (i + AHEAD < n) {
            int64_t t = via_slot_at ? slot_at[list[i + AHEAD]] : list[i + AHEAD];
            if (t >= 0) __builtin_prefetch(&words[pos[t] * W], 0, 0);
        }
        int64_t s = via_slot_at ? slot_at[list[i]] : list[i];
        if (s < 0) continue;
        if (test == 1 && uses[s] >= lo) continue;
        if (test == 2 && uses[s] != -1) continue;
        uses[s] = first_set(&words[pos[s] * W], seg_word, seg_mask, seg_base, nseg);
    }
}

/* The indices i (ascending) where a[i] != b[i]: written to out, counted. */
int64_t cemb_changed(const int64_t *a, const int64_t *b, int64_t n, int64_t *out) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        out[count] = i;
        count += a[i] != b[i];
    }
    return count;
}

/* Batches from `now` to each first use (-1 stays -1): the policy's form of a slot_uses answer, in one pass. */
void cemb_relative(const int64_t *uses, int64_t n, int64_t now, int64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = uses[i] < 0 ? -1 : uses[i] - now;
}
