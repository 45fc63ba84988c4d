/* Batched positional I/O of table records for cachedemb.storage (loaded with ctypes, which releases the GIL for
 * the call): one call per span of records, the loop in C. Span i covers records [starts[i], starts[i + 1]) of
 * `buf` (record `rec` bytes each) at the ascending file offsets `offsets`: for a write, adjacent records (one
 * pwrite); for a read, records at most a small gap apart (one preadv, the gaps read into a scratch buffer: a
 * record near the one before it, in the same or the next page, then costs a copy instead of a call and a page
 * lookup). Returns 0, -errno on an error, or 1 + i when span i hit the end of the file (a short read).
 *
 * Every write shorter than two pages goes in one call; a longer one goes in pieces that end at page boundaries
 * (`write_paged`). The page cache sizes the folio a write creates by the write's length, and on a file system
 * with large folios (ext4 since Linux 6.16) a later small write into a large folio walks every block of it: a
 * 264-byte record written into a folio of a 4 MiB creation write cost 7.5-8.5 us of kernel time, into a 4 KiB
 * folio 1.35-2.2 us (measured on 6.18). Records are rewritten one at a time for the table's whole life, so the
 * writes that create its pages (creation, copy-on-write, long runs) keep them small.
 */
#include <errno.h>
#include <stdint.h>
#include <sys/uio.h>
#include <unistd.h>

#define PAGE 4096
#define READ_GAP 2048 /* as rowio.py's READ_GAP: the most bytes between two records one read spans */
#define IOVS 1024     /* iovecs a call (IOV_MAX on Linux) */
#define COPY_BUF (64 * 1024)

static int64_t write_paged(int fd, const char *p, size_t want, off_t off) {
    while (want > 0) {
        size_t piece = want;
        if (want >= 2 * PAGE) {
            piece = PAGE - (size_t)(off % PAGE);
        }
        ssize_t put = pwrite(fd, p, piece, off);
        if (put < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        p += put;
        want -= (size_t)put;
        off += put;
    }
    return 0;
}

/* `len` bytes of `buf` at file offset `off` (see write_paged). Returns 0 or -errno. */
int64_t cemb_pwrite_paged(int fd, const char *buf, int64_t len, int64_t off) {
    return write_paged(fd, buf, (size_t)len, (off_t)off);
}

/* Copy `len` bytes of the file from offset `src` to `dst` (ranges apart) through a 64 KiB buffer, written
 * paged. Returns 0, -errno, or 1 when the source ends early. */
int64_t cemb_copy_paged(int fd, int64_t src, int64_t dst, int64_t len) {
    char buf[COPY_BUF];
    while (len > 0) {
        size_t want = len < COPY_BUF ? (size_t)len : COPY_BUF;
        ssize_t got = pread(fd, buf, want, (off_t)src);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) return 1;
        int64_t rc = write_paged(fd, buf, (size_t)got, (off_t)dst);
        if (rc < 0) return rc;
        src += got;
        dst += got;
        len -= got;
    }
    return 0;
}

/* Records [a, b) one at a time: where a gathered read came back short (the end of the file, or a signal). */
static int64_t pread_each(int fd, const int64_t *offsets, int64_t a, int64_t b, int64_t rec, char *buf) {
    for (int64_t j = a; j < b; j++) {
        char *p = buf + j * rec;
        size_t want = (size_t)rec;
        off_t off = (off_t)offsets[j];
        while (want > 0) {
            ssize_t got = pread(fd, p, want, off);
            if (got < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            if (got == 0) return 1;
            p += got;
            want -= (size_t)got;
            off += got;
        }
    }
    return 0;
}

int64_t cemb_pread_spans(int fd, const int64_t *offsets, const int64_t *starts, int64_t nspans, int64_t rec,
                         char *buf) {
    static __thread char gap[READ_GAP];
    struct iovec iov[IOVS];
    for (int64_t i = 0; i < nspans; i++) {
        int64_t j = starts[i], b = starts[i + 1];
        while (j < b) {  /* a call per IOVS iovecs of the span */
            int64_t first = j, end = offsets[j];
            int k = 0;
            size_t want = 0;
            while (j < b && k + 2 <= IOVS) {
                int64_t skip = offsets[j] - end;
                if (skip < 0 || skip > READ_GAP) break; /* spans not grouped by rowio.spans: one more call */
                if (skip > 0) {
                    iov[k].iov_base = gap;
                    iov[k++].iov_len = (size_t)skip;
                    want += (size_t)skip;
                }
                iov[k].iov_base = buf + j * rec;
                iov[k++].iov_len = (size_t)rec;
                want += (size_t)rec;
                end = offsets[j] + rec;
                j++;
            }
            ssize_t got;
            do {
                got = preadv(fd, iov, k, (off_t)offsets[first]);
            } while (got < 0 && errno == EINTR);
            if (got < 0) return -errno;
            if ((size_t)got < want) {
                int64_t rc = pread_each(fd, offsets, first, j, rec, buf);
                if (rc < 0) return rc;
                if (rc > 0) return 1 + i;
            }
        }
    }
    return 0;
}

int64_t cemb_pwrite_spans(int fd, const int64_t *offsets, const int64_t *starts, int64_t nspans, int64_t rec,
                          const char *buf) {
    for (int64_t i = 0; i < nspans; i++) {
        int64_t a = starts[i], b = starts[i + 1];
        int64_t rc = write_paged(fd, buf + a * rec, (size_t)((b - a) * rec), (off_t)offsets[a]);
        if (rc < 0) return rc;
    }
    return 0;
}
