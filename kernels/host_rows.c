/* Row copies between CPU tensors in one pass (kernels/host_rows.py), loaded with ctypes (no GIL):
 * dst[d[i]] = src[s[i]] (`row` bytes) for i < n where 0 <= s[i] < rs and 0 <= d[i] < rd; other pairs are skipped.
 * The two tensors do not overlap and the destinations are distinct (the callers' contract). */
#include <stdint.h>
#include <string.h>

void cemb_copy_rows(const char *src, int64_t rs, const int64_t *s, char *dst, int64_t rd, const int64_t *d,
                    int64_t n, int64_t row) {
    for (int64_t i = 0; i < n; i++) {
        int64_t a = s[i], b = d[i];
        if (a < 0 || b < 0 || a >= rs || b >= rd) continue;
        memcpy(dst + b * row, src + a * row, (size_t)row);
    }
}
