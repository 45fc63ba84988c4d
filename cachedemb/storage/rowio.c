/* Batched positional I/O of table records for cachedemb.storage (loaded with ctypes, which releases the GIL for
 * the call): one pread / pwrite per run of adjacent records, the loop in C. Span i covers records
 * [starts[i], starts[i + 1]) of `buf` (record `rec` bytes each), at file offset offsets[starts[i]].
 * Returns 0, -errno on an error, or 1 + i when span i hit the end of the file (a short read).
 */
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

int64_t cemb_pread_spans(int fd, const int64_t *offsets, const int64_t *starts, int64_t nspans, int64_t rec,
                         char *buf) {
    for (int64_t i = 0; i < nspans; i++) {
        int64_t a = starts[i], b = starts[i + 1];
        char *p = buf + a * rec;
        size_t want = (size_t)((b - a) * rec);
        off_t off = (off_t)offsets[a];
        while (want > 0) {
            ssize_t got = pread(fd, p, want, off);
            if (got < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            if (got == 0) return 1 + i;
            p += got;
            want -= (size_t)got;
            off += got;
        }
    }
    return 0;
}

int64_t cemb_pwrite_spans(int fd, const int64_t *offsets, const int64_t *starts, int64_t nspans, int64_t rec,
                          const char *buf) {
    for (int64_t i = 0; i < nspans; i++) {
        int64_t a = starts[i], b = starts[i + 1];
        const char *p = buf + a * rec;
        size_t want = (size_t)((b - a) * rec);
        off_t off = (off_t)offsets[a];
        while (want > 0) {
            ssize_t put = pwrite(fd, p, want, off);
            if (put < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            p += put;
            want -= (size_t)put;
            off += put;
        }
    }
    return 0;
}
