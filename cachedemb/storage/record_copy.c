/* A table record's fields to and from the host cache's row tensors in one pass (record_copy.py). Loaded with
 * ctypes, which releases the GIL: the file tier's reader threads land their records without running torch ops
 * that take turns with the training thread for the GIL. */
#include <stdint.h>
#include <string.h>

#define AHEAD 8 /* records whose slab rows are prefetched ahead (as kernels/host_rows.c) */

/* For each record i < n: row = rows[i] (or rows[order[i]] when order is given); each field f copies len[f]
 * bytes between the record's offset off[f] and base[f] + row * stride[f]. to_records: rows -> records (the
 * record is zeroed first, so padding bytes are 0), else records -> rows. */
void cemb_record_copy(uint8_t *records, int64_t rec, int64_t n, const int64_t *rows, const int64_t *order,
                      int64_t nf, const int64_t *off, const int64_t *len, const int64_t *base, const int64_t *stride,
                      int64_t to_records) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {  /* the slab rows sit at random: ask for a later record's lines now */
            int64_t ahead = order ? rows[order[i + AHEAD]] : rows[i + AHEAD];
            for (int64_t f = 0; f < nf; f++) {
                const uint8_t *field = (const uint8_t *)(intptr_t)base[f] + ahead * stride[f];
                for (int64_t o = 0; o < len[f]; o += 64) {
                    if (to_records) __builtin_prefetch(field + o, 0, 0);
                    else __builtin_prefetch(field + o, 1, 0);
                }
            }
        }
        int64_t row = order ? rows[order[i]] : rows[i];
        uint8_t *r = records + i * rec;
        if (to_records) memset(r, 0, (size_t)rec);
        for (int64_t f = 0; f < nf; f++) {
            uint8_t *field = (uint8_t *)(intptr_t)base[f] + row * stride[f];
            if (to_records) memcpy(r + off[f], field, (size_t)len[f]);
            else memcpy(field, r + off[f], (size_t)len[f]);
        }
    }
}
