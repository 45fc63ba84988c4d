/* A stable sort of host int64 keys with its permutation (kernels/host_sort.py), loaded with ctypes (no GIL):
 * an LSD radix sort of the packed keys ((key - low) << pbits | position) over the key's kbits only. The packed
 * keys start in position order and every pass is stable, so the order of equal keys is their input order, as
 * torch.sort(stable=True) leaves it. O(n) per pass, at most four passes of <= 12-bit digits (kbits <= 48); all
 * digit histograms are counted in the packing pass. `values` and `perm` (n each) double as the two buffers. */
#include <stdint.h>
#include <stdlib.h>

int cemb_radix_sort(const int64_t *keys, int64_t n, int64_t low, int64_t kbits, int64_t pbits, int64_t *values,
                    int64_t *perm) {
    if (kbits < 0 || kbits > 48 || pbits < 1 || kbits + pbits > 63) return 0;
    int64_t passes = (kbits + 11) / 12;
    int64_t width = passes ? (kbits + passes - 1) / passes : 0;
    int64_t bins = (int64_t)1 << width, mask = bins - 1;
    int64_t *count = passes ? (int64_t *)calloc((size_t)(passes * bins), sizeof(int64_t)) : NULL;
    if (passes && count == NULL) return 0;
    int64_t *src = perm, *dst = values;
    for (int64_t i = 0; i < n; i++) {
        int64_t key = keys[i] - low;
        src[i] = (key << pbits) | i;
        for (int64_t p = 0; p < passes; p++) count[p * bins + ((key >> (p * width)) & mask)]++;
    }
    for (int64_t p = 0; p < passes; p++) {
        int64_t *c = count + p * bins, sum = 0, shift = pbits + p * width;
        for (int64_t b = 0; b < bins; b++) {
            int64_t here = c[b];
            c[b] = sum;
            sum += here;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t v = src[i];
            dst[c[(v >> shift) & mask]++] = v;
        }
        int64_t *t = src;
        src = dst;
        dst = t;
    }
    free(count);
    int64_t low_mask = (((int64_t)1) << pbits) - 1;
    for (int64_t i = 0; i < n; i++) {  /* src is values or perm: each index read before it is written */
        int64_t v = src[i];
        values[i] = (v >> pbits) + low;
        perm[i] = v & low_mask;
    }
    return 1;
}
