/* SGD on float32 CPU rows in one pass (kernels/host_sgd.py), loaded with ctypes (no GIL):
 * rows[idx[i], :] = fma(alpha, g[i, :], rows[idx[i], :]) for distinct idx, which is what torch's
 * `w.add_(g, alpha=alpha)` computes on a CPU with FMA (its vectorized add is a fused multiply-add), so the rows
 * are the same bit for bit as the torch code's gather / add_ / scatter. The rows are random in a large table:
 * each row ahead is prefetched (about half the time of the plain loop). Returns 1 when done; 0, with nothing
 * written, where the CPU has no FMA or an index is out of range. */
#include <stdint.h>

#define AHEAD 8 /* rows prefetched ahead */

#if defined(__x86_64__) || defined(__i386__)
#define FMA_TARGET __attribute__((target("fma")))
#define HAVE_FMA() __builtin_cpu_supports("fma")
#else
#define FMA_TARGET
#define HAVE_FMA() 1
#endif

FMA_TARGET static void sgd(float *rows, const int64_t *idx, int64_t n, const float *g, int64_t dim, float alpha) {
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            const char *p = (const char *)(rows + idx[i + AHEAD] * dim);
            for (int64_t b = 0; b < dim * (int64_t)sizeof(float); b += 64) __builtin_prefetch(p + b, 1, 3);
        }
        float *w = rows + idx[i] * dim;
        const float *gi = g + i * dim;
        for (int64_t d = 0; d < dim; d++) w[d] = __builtin_fmaf(alpha, gi[d], w[d]);
    }
}

int64_t cemb_sgd_rows(float *rows, int64_t nrows, const int64_t *idx, int64_t n, const float *g, int64_t dim,
                      double alpha) {
    if (!HAVE_FMA()) return 0;
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= nrows) return 0;
    sgd(rows, idx, n, g, dim, (float)alpha);
    return 1;
}
