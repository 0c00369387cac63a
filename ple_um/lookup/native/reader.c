/* The reader: the rows a lookup found missing read from the files many at a time (rowcopy.h says
 * what the files do and what nothing here may do).
 *
 * A row faulted in through the mapping costs one storage round trip, and a thread that copies rows
 * waits for each fault in turn. Here the missing rows of a window are read with many reads in
 * flight, so the window costs about one round trip per `depth` rows:
 * - READ_URING: io_uring, one ring per reading thread (uring.c), up to `depth` reads at once;
 * - READ_THREADS: a pool of reader threads issuing preads, the calling thread reading too;
 * - READ_FAULT: through the mapping, one fault at a time.
 * With `align` > 0 the reads are O_DIRECT: whole aligned blocks into a bounce buffer, the row's
 * bytes copied out. They bypass the page cache, so a row kept in the row cache does not also hold
 * a 4 KiB page of it. A read that the file cannot serve (O_DIRECT refused) is made through the
 * mapping instead. Every result of every call is taken: a short read is finished; a read that fails
 * (or a ring's read that did not complete) is made once more by pread; one that still cannot give
 * the row (an I/O error, a file shorter than its header said) gives a zero row, counted as broken,
 * its miss marked (mapped = NULL) so that nobody caches it. A ring that fails hands what is left to
 * the reader threads, which read the table's misses from then on (ple_reader_t.failed says why).
 * Without a row cache, a miss whose pages are resident is copied from the mapping instead of read,
 * where the file holds all of it: a file truncated under the reader keeps the page its new end
 * falls in resident, zeros past that end.
 */
#include "reader.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHUNK 512 /* misses sorted into copied and read at a time (copy_cold hands over a window's) */

void ple_ring_failed(const ple_rows_t *t, int call, int err) {
    int32_t none = 0;
    if (t->reader->failed != NULL)
        __atomic_compare_exchange_n(t->reader->failed, &none, (int32_t)(call << 16 | (err & 0xFFFF)), 0,
                                    __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

static int ring_given_up(const ple_rows_t *t) {
    return t->reader->failed != NULL && __atomic_load_n(t->reader->failed, __ATOMIC_ACQUIRE) != 0;
}

/* The bytes [done, len) of a read of `len` at `offset` into buf: short reads finished (an O_DIRECT
 * one resumed at the block it ended in: O_DIRECT reads whole blocks), EINTR retried. The bytes
 * read from the start (fewer than len: the file ended, or a read failed after some bytes), or
 * -errno where nothing was read. */
static int64_t pread_from(int fd, uint8_t *buf, int64_t len, int64_t offset, int64_t done, int64_t align) {
    while (done < len) {
        int64_t at = align > 0 ? done & ~(align - 1) : done;
        ssize_t r = pread(fd, buf + at, (size_t)(len - at), (off_t)(offset + at));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return done > 0 ? done : -errno;
        if (at + r <= done) break; /* nothing new: the end of the file */
        done = at + r;
    }
    return done;
}

/* A read of the row's span into buf that gave `got` bytes (negative: -errno) lands in the row, or is
 * made through the mapping (O_DIRECT refused), or fails: a zero row, counted, never cached. */
static void settle(const ple_rows_t *t, ple_miss_t *m, uint8_t *dst, const uint8_t *buf, int64_t skip, int64_t got,
                   tally_t *n) {
    uint8_t *row = dst + m->pos * t->rb;
    if (got >= skip + t->rb) {
        if (buf + skip != row) memcpy(row, buf + skip, (size_t)t->rb);
    } else if (got == -EINVAL || got == -EOPNOTSUPP) {
        memcpy(row, m->mapped, (size_t)t->rb);
    } else {
        memset(row, 0, (size_t)t->rb);
        m->mapped = NULL;
        n->broken++;
    }
}

/* A bounce buffer for one read, aligned for O_DIRECT, per thread (grown, never freed: threads that
 * read are long-lived). */
static uint8_t *bounce(int64_t bytes) {
    static __thread uint8_t *buf;
    static __thread int64_t size;
    if (size < bytes) {
        free(buf);
        buf = NULL, size = 0;
        if (posix_memalign((void **)&buf, PAGE, (size_t)bytes) != 0) return NULL;
        size = bytes;
    }
    return buf;
}

void ple_read_rest(const ple_rows_t *t, ple_miss_t *m, uint8_t *dst, uint8_t *buf, int64_t got, tally_t *n) {
    int64_t offset, start, len, skip;
    int fd = row_at(t, m->id, &offset);
    span(t, offset, &start, &len, &skip);
    if (fd < 0 || buf == NULL) got = -EINVAL;
    else if (got < len && got != -EINVAL && got != -EOPNOTSUPP)
        got = pread_from(fd, buf, len, start, got > 0 ? got : 0, t->reader->align);
    settle(t, m, dst, buf, skip, got, n);
}

void ple_read_one(const ple_rows_t *t, ple_miss_t *m, uint8_t *dst, tally_t *n) {
    int64_t offset, start, len, skip;
    row_at(t, m->id, &offset);
    span(t, offset, &start, &len, &skip);
    ple_read_rest(t, m, dst, t->reader->align > 0 ? bounce(len) : dst + m->pos * t->rb, 0, n);
}

/* ---- READ_THREADS: reader threads that claim the misses of posted jobs ------------------------- */
typedef struct read_job {
    const ple_rows_t *t;
    ple_miss_t *misses;
    uint8_t *dst;
    int64_t n;
    atomic_llong next, done, broken;
    atomic_int users; /* reader threads holding it: the caller's frame outlives them */
    struct read_job *link;
} read_job_t;

static pthread_mutex_t r_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t r_cv = PTHREAD_COND_INITIALIZER;
static read_job_t *r_jobs; /* posted jobs with misses left to claim */
static pthread_t r_ids[MAX_DEPTH];
static int r_threads, r_stop; /* threads started; set while they are being stopped */
static pthread_mutex_t r_life = PTHREAD_MUTEX_INITIALIZER; /* the holders, and the stop */
static int r_holders;

/* Claim and read one miss of `j`; 0 when none is left. */
static int read_claimed(read_job_t *j) {
    int64_t i = atomic_fetch_add(&j->next, 1);
    if (i >= j->n) return 0;
    tally_t n = {0, 0};
    ple_read_one(j->t, &j->misses[i], j->dst, &n);
    if (n.broken) atomic_fetch_add(&j->broken, n.broken);
    atomic_fetch_add_explicit(&j->done, 1, memory_order_release);
    return 1;
}

static void *reader_thread(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&r_mu);
        while (r_jobs == NULL && !r_stop) pthread_cond_wait(&r_cv, &r_mu);
        if (r_stop) { /* a job's caller reads what nobody claimed itself */
            pthread_mutex_unlock(&r_mu);
            return NULL;
        }
        read_job_t *j = r_jobs;
        if (atomic_load(&j->next) >= j->n) { /* fully claimed: off the list */
            r_jobs = j->link;
            pthread_mutex_unlock(&r_mu);
            continue;
        }
        atomic_fetch_add(&j->users, 1);
        pthread_mutex_unlock(&r_mu);
        while (read_claimed(j)) {
        }
        atomic_fetch_sub_explicit(&j->users, 1, memory_order_release);
    }
}

static void unlist(read_job_t *j) {
    pthread_mutex_lock(&r_mu);
    for (read_job_t **p = &r_jobs; *p; p = &(*p)->link)
        if (*p == j) {
            *p = j->link;
            break;
        }
    pthread_mutex_unlock(&r_mu);
}

tally_t ple_read_threads(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst) {
    read_job_t j = {.t = t, .misses = misses, .dst = dst, .n = n};
    int want = t->reader->depth < MAX_DEPTH ? t->reader->depth : MAX_DEPTH;
    pthread_mutex_lock(&r_mu);
    for (; r_threads < want - 1 && !r_stop; r_threads++) {
        if (pthread_create(&r_ids[r_threads], NULL, reader_thread, NULL) != 0) break;
        pthread_setname_np(r_ids[r_threads], "ple-um-reader"); /* named by now: top -H, the tests */
    }
    j.link = r_jobs, r_jobs = &j;
    pthread_cond_broadcast(&r_cv);
    pthread_mutex_unlock(&r_mu);
    while (read_claimed(&j)) {
    }
    while (atomic_load_explicit(&j.done, memory_order_acquire) < n) relax();
    unlist(&j); /* no thread picks it up any more; wait for those that did */
    while (atomic_load_explicit(&j.users, memory_order_acquire) > 0) relax();
    return (tally_t){0, atomic_load(&j.broken)};
}

void ple_reader_hold(void) {
    pthread_mutex_lock(&r_life);
    r_holders++;
    pthread_mutex_unlock(&r_life);
}

/* The last holder let go: the reader threads are stopped and joined (no lookup reads any more). */
void ple_reader_release(void) {
    pthread_mutex_lock(&r_life);
    if (r_holders > 0 && --r_holders == 0) {
        pthread_mutex_lock(&r_mu);
        int started = r_threads;
        r_stop = 1;
        pthread_cond_broadcast(&r_cv);
        pthread_mutex_unlock(&r_mu);
        for (int k = 0; k < started; k++) pthread_join(r_ids[k], NULL);
        pthread_mutex_lock(&r_mu);
        r_threads = 0, r_stop = 0;
        pthread_mutex_unlock(&r_mu);
    }
    pthread_mutex_unlock(&r_life);
}

/* A forked child has only the thread that forked: no reader threads, every lock free. */
static void after_fork_in_child(void) {
    r_jobs = NULL, r_threads = 0, r_stop = 0;
    pthread_mutex_init(&r_mu, NULL);
    pthread_mutex_init(&r_life, NULL);
    pthread_cond_init(&r_cv, NULL);
}

__attribute__((constructor)) static void hook_fork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

/* ---- the misses of a lookup ----------------------------------------------------------------------- */
static tally_t read_all(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst, int64_t *counts) {
    long t0 = now_ns();
    tally_t out;
    if (t->reader->strategy == READ_URING && !ring_given_up(t)) out = ple_read_uring(t, misses, n, dst);
    else out = ple_read_threads(t, misses, n, dst);
    count(counts, C_FILE_READS, n);
    count(counts, C_READ_NS, now_ns() - t0);
    return out;
}

/* The sizes of the files a chunk's rows lie in, each file's read once (an fstat), when first asked:
 * kept per shard (-1: not asked yet), a shard whose file another shard asked for already taking
 * its size. sizes: t->shards entries, or NULL (no memory for them): an fstat at each ask. */
typedef struct {
    int64_t *sizes;
} file_sizes_t;

static int64_t file_size(const ple_rows_t *t, file_sizes_t *f, int64_t shard) {
    const int32_t *fds = t->reader->fds;
    int64_t *sizes = f->sizes, size = -1;
    if (sizes != NULL && sizes[shard] >= 0) return sizes[shard];
    for (int64_t s = 0; sizes != NULL && s < t->shards && size < 0; s++)
        if (fds[s] == fds[shard]) size = sizes[s];
    if (size < 0) {
        struct stat st;
        size = fstat(fds[shard], &st) == 0 ? (int64_t)st.st_size : INT64_MAX;
    }
    if (sizes != NULL) sizes[shard] = size;
    return size;
}

/* Whether the file holds all of the row of `m` now. */
static int in_file(const ple_rows_t *t, const ple_miss_t *m, file_sizes_t *f) {
    int64_t offset;
    int fd = row_at(t, m->id, &offset);
    return fd < 0 || offset + t->rb <= file_size(t, f, m->id / t->per_shard);
}

/* Room for n file sizes, per thread (grown, never freed: threads that read are long-lived), or NULL
 * where there is no memory for them. */
static int64_t *size_room(int64_t n) {
    static __thread int64_t *room;
    static __thread int64_t size;
    if (size < n) {
        int64_t *grown = realloc(room, (size_t)n * sizeof *grown);
        if (grown == NULL) return NULL;
        room = grown, size = n;
    }
    return room;
}

/* A table without a row cache: the misses whose pages are resident copied from the mapping, the
 * others read. A resident page may lie past the end of a truncated file (the page the end falls
 * in, or one of a large folio the truncation could not split), and touching it past that page is
 * SIGBUS: a row is copied only where its file held all of it just before, and kept only where it
 * still does just after (a row it holds then was whole when copied). */
static tally_t read_unless_resident(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst,
                                    int64_t *counts) {
    tally_t out = {0, 0};
    ple_miss_t reads[CHUNK];
    int16_t from[CHUNK], copied[CHUNK];
    int64_t *sizes = size_room(2 * t->shards); /* a chunk's sizes before and after its copies */
    for (int64_t a = 0; a < n; a += CHUNK) {
        int64_t b = a + CHUNK < n ? a + CHUNK : n, r = 0, c = 0;
        for (int64_t k = 0; sizes != NULL && k < 2 * t->shards; k++) sizes[k] = -1;
        file_sizes_t before = {sizes}, after = {sizes != NULL ? sizes + t->shards : NULL};
        for (int64_t k = a; k < b; k++) {
            if (ple_resident(misses[k].mapped, t->rb) && in_file(t, &misses[k], &before)) {
                memcpy(dst + misses[k].pos * t->rb, misses[k].mapped, (size_t)t->rb);
                copied[c++] = (int16_t)(k - a);
            } else {
                from[r] = (int16_t)(k - a), reads[r++] = misses[k];
            }
        }
        if (r) tally_add(&out, read_all(t, reads, r, dst, counts));
        for (int64_t k = 0; k < r; k++) misses[a + from[k]].mapped = reads[k].mapped;
        for (int64_t k = 0; k < c; k++) {
            ple_miss_t *m = &misses[a + copied[k]];
            if (in_file(t, m, &after)) continue;
            memset(dst + m->pos * t->rb, 0, (size_t)t->rb);
            m->mapped = NULL;
            out.broken++;
        }
    }
    return out;
}

tally_t ple_read_misses(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst, int64_t *counts) {
    if (t->reader == NULL || t->reader->strategy == READ_FAULT) {
        for (int64_t j = 0; j < n; j++) memcpy(dst + misses[j].pos * t->rb, misses[j].mapped, (size_t)t->rb);
        return (tally_t){0, 0};
    }
    if (t->cache == NULL && t->reader->resident_check) return read_unless_resident(t, misses, n, dst, counts);
    return read_all(t, misses, n, dst, counts);
}

/* Whether every page of the rb bytes at row is resident (a row of any size: 64 pages a call). */
int ple_resident(const uint8_t *row, int64_t rb) {
    uintptr_t first = (uintptr_t)row & ~(uintptr_t)(PAGE - 1), last = ((uintptr_t)row + (uintptr_t)rb - 1) & ~(uintptr_t)(PAGE - 1);
    unsigned char vec[64];
    for (uintptr_t at = first; at <= last; at += sizeof vec * PAGE) {
        size_t pages = (last - at) / PAGE + 1 < sizeof vec ? (last - at) / PAGE + 1 : sizeof vec;
        if (mincore((void *)at, pages * PAGE, vec) != 0) return 0;
        for (size_t k = 0; k < pages; k++)
            if (!(vec[k] & 1)) return 0;
    }
    return 1;
}

/* The pages of `rows` not in memory asked for at once (MADV_WILLNEED: the kernel reads them ahead
 * while the caller goes on to touch them in turn). */
void ple_touch_pages(const ple_rows_t *t, const ple_miss_t *rows, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        uintptr_t first = (uintptr_t)rows[j].mapped & ~(uintptr_t)(PAGE - 1);
        uintptr_t last = ((uintptr_t)rows[j].mapped + (uintptr_t)t->rb - 1) & ~(uintptr_t)(PAGE - 1);
        if (!ple_resident(rows[j].mapped, t->rb)) madvise((void *)first, last - first + PAGE, MADV_WILLNEED);
    }
}
