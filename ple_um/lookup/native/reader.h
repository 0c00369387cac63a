/* What the reader's two files share (reader.c: reads by pread and the reader threads; uring.c: reads
 * through io_uring): where a miss's row lies in the files, and the reads both make. rowcopy.h says
 * what the files do and what nothing here may do. Nothing here is called from outside the library.
 */
#ifndef PLE_READER_H
#define PLE_READER_H

#include "rowcopy.h"

#define PAGE 4096
#define MAX_DEPTH 256 /* reads in flight per reading thread, at most (a ring's entries) */
#define PLE_INTERNAL __attribute__((visibility("hidden")))

/* Where the file holds the row of a miss: descriptor, offset. */
static inline int row_at(const ple_rows_t *t, int64_t id, int64_t *offset) {
    int64_t s = id / t->per_shard, r = id - s * t->per_shard;
    *offset = t->reader->offsets[s] + r * t->rb;
    return t->reader->fds[s];
}

/* The bytes of a read of the row at `offset`: [start, start + len) of the file, the row at skip. */
static inline void span(const ple_rows_t *t, int64_t offset, int64_t *start, int64_t *len, int64_t *skip) {
    int64_t a = t->reader->align;
    if (a <= 0) {
        *start = offset, *len = t->rb, *skip = 0;
        return;
    }
    *start = offset & ~(a - 1);
    *skip = offset - *start;
    *len = (*skip + t->rb + a - 1) & ~(a - 1);
}

/* reader.c */
/* One miss read by the calling thread with pread. */
PLE_INTERNAL void ple_read_one(const ple_rows_t *t, ple_miss_t *m, uint8_t *dst, tally_t *n);
/* A read made elsewhere that gave `got` bytes of the row's span into buf (negative: -errno) made
 * whole: a short one finished, a failed one made once more, by pread; a zero row where that fails. */
PLE_INTERNAL void ple_read_rest(const ple_rows_t *t, ple_miss_t *m, uint8_t *dst, uint8_t *buf, int64_t got,
                                tally_t *n);
/* Misses read by the reader threads (the calling thread reading too). */
PLE_INTERNAL tally_t ple_read_threads(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst);
/* The table's ring failed in `call` (RING_SETUP, ...) with errno `err`: kept in reader->failed (the
 * first failure only); its misses are read by the reader threads from then on. */
PLE_INTERNAL void ple_ring_failed(const ple_rows_t *t, int call, int err);

/* uring.c: misses read through this thread's ring; where the ring cannot be had or fails, what is
 * left of them by the reader threads (and ple_ring_failed says so). */
PLE_INTERNAL tally_t ple_read_uring(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst);

#endif
