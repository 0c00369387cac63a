/* The reader: the rows a lookup found missing read from the files many at a time (rowcopy.h says
 * what the files do and what nothing here may do).
 *
 * A row faulted in through the mapping costs one storage round trip, and a thread that copies rows
 * waits for each fault in turn. Here the missing rows of a window are read with many reads in
 * flight, so the window costs about one round trip per `depth` rows:
 * - READ_URING: io_uring, one ring per reading thread (made on first use), up to `depth` reads
 *   submitted at once;
 * - READ_THREADS: a pool of reader threads issuing preads, the calling thread reading too;
 * - READ_FAULT: through the mapping, one fault at a time.
 * With `align` > 0 the reads are O_DIRECT: whole aligned blocks into a bounce buffer, the row's
 * bytes copied out. They bypass the page cache, so a row kept in the row cache does not also hold
 * a 4 KiB page of it. A read that the file cannot serve (O_DIRECT refused) is made through the
 * mapping instead; one that fails (an I/O error, a file shorter than its header said) gives a zero
 * row, counted as broken, and its miss is marked (mapped = NULL) so that nobody caches it.
 */
#include "rowcopy.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define HAVE_URING 1
#endif
#endif

#define PAGE 4096
#define MAX_DEPTH 256

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

/* A read that returned `got` bytes of `len` (negative: -errno) lands in dst, or is made through the
 * mapping (O_DIRECT refused), or fails: a zero row, counted, never cached. */
static void settle(const ple_rows_t *t, ple_miss_t *m, uint8_t *dst, const uint8_t *buf, int64_t skip, int64_t got,
                   int64_t len, tally_t *n) {
    uint8_t *row = dst + m->pos * t->rb;
    if (got == len || (got >= skip + t->rb && got > 0)) {
        memcpy(row, buf + skip, (size_t)t->rb);
    } else if (got == -EINVAL || got == -EOPNOTSUPP) {
        memcpy(row, m->mapped, (size_t)t->rb);
    } else {
        memset(row, 0, (size_t)t->rb);
        m->mapped = NULL;
        n->broken++;
    }
}

static int64_t pread_all(int fd, uint8_t *buf, int64_t len, int64_t offset) {
    int64_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, buf + done, (size_t)(len - done), offset + done);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -errno;
        if (r == 0) break;
        done += r;
    }
    return done;
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

/* One miss read by the calling thread with a pread. */
static void read_one(const ple_rows_t *t, ple_miss_t *m, uint8_t *dst, uint8_t *buf, tally_t *n) {
    int64_t offset, start, len, skip;
    int fd = row_at(t, m->id, &offset);
    span(t, offset, &start, &len, &skip);
    if (t->reader->align <= 0) {
        int64_t got = fd < 0 ? -EINVAL : pread_all(fd, dst + m->pos * t->rb, len, start);
        if (got == len) return;
        settle(t, m, dst, dst + m->pos * t->rb, 0, got, len, n);
        return;
    }
    int64_t got = fd < 0 || buf == NULL ? -EINVAL : pread_all(fd, buf, len, start);
    settle(t, m, dst, buf, skip, got, len, n);
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
static int r_threads;

/* Claim and read one miss of `j`; 0 when none is left. */
static int read_claimed(read_job_t *j) {
    int64_t i = atomic_fetch_add(&j->next, 1);
    if (i >= j->n) return 0;
    const ple_rows_t *t = j->t;
    tally_t n = {0, 0};
    int64_t len = t->reader->align > 0 ? ((t->rb + 2 * t->reader->align - 1) & ~(t->reader->align - 1)) : 0;
    read_one(t, &j->misses[i], j->dst, len ? bounce(len) : NULL, &n);
    if (n.broken) atomic_fetch_add(&j->broken, n.broken);
    atomic_fetch_add_explicit(&j->done, 1, memory_order_release);
    return 1;
}

static void *reader_thread(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&r_mu);
        while (r_jobs == NULL) pthread_cond_wait(&r_cv, &r_mu);
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
    return NULL;
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

static tally_t read_threads(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst) {
    read_job_t j = {.t = t, .misses = misses, .dst = dst, .n = n};
    int want = t->reader->depth < MAX_DEPTH ? t->reader->depth : MAX_DEPTH;
    pthread_mutex_lock(&r_mu);
    for (; r_threads < want - 1; r_threads++) {
        pthread_t th;
        if (pthread_create(&th, NULL, reader_thread, NULL) != 0) break;
        pthread_detach(th);
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

/* ---- READ_URING ---------------------------------------------------------------------------------- */
#ifdef HAVE_URING
typedef struct {
    int fd;
    unsigned entries;
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    uint8_t *buffers; /* entries bounce buffers of `each` bytes */
    int64_t each;
    void *maps[2];
    size_t map_bytes[2];
} ring_t;

static __thread ring_t t_ring;
static __thread int t_ring_state; /* 0 not made, 1 made, -1 failed */
/* A thread's ring is let go when the thread ends (its key's destructor): threads that come and go
 * (a prefetch's pool, a caller's worker threads) would otherwise leave a ring each, an fd and its
 * mapped queues, for the life of the process. */
static pthread_key_t ring_key;
static pthread_once_t ring_key_once = PTHREAD_ONCE_INIT;

static void ring_unmake(ring_t *r, int fd) {
    for (int k = 0; k < 2; k++)
        if (r->maps[k] != MAP_FAILED) munmap(r->maps[k], r->map_bytes[k]);
    close(fd);
}

static int ring_make(ring_t *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) return -1;
    size_t sq_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_bytes = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (cq_bytes > sq_bytes) sq_bytes = cq_bytes;
    uint8_t *sq = mmap(NULL, sq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    void *sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    r->maps[0] = sq, r->maps[1] = sqes;
    r->map_bytes[0] = sq_bytes, r->map_bytes[1] = p.sq_entries * sizeof(struct io_uring_sqe);
    if (sq == MAP_FAILED || sqes == MAP_FAILED || !(p.features & IORING_FEAT_SINGLE_MMAP)) {
        ring_unmake(r, fd);
        return -1;
    }
    r->fd = fd, r->entries = p.sq_entries;
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail), r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(sq + p.cq_off.head), r->cq_tail = (unsigned *)(sq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(sq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(sq + p.cq_off.cqes);
    r->sqes = sqes;
    r->buffers = NULL, r->each = 0;
    return 0;
}

static void ring_release(void *arg) {
    ring_t *r = arg;
    if (t_ring_state == 1) {
        ring_unmake(r, r->fd);
        free(r->buffers);
    }
    t_ring_state = 0;
}

static void ring_key_make(void) { (void)pthread_key_create(&ring_key, ring_release); }

static ring_t *ring_for(int64_t each) {
    ring_t *r = &t_ring;
    if (t_ring_state == 0) {
        t_ring_state = ring_make(r, MAX_DEPTH) == 0 ? 1 : -1;
        pthread_once(&ring_key_once, ring_key_make);
        if (t_ring_state == 1) (void)pthread_setspecific(ring_key, r);
    }
    if (t_ring_state < 0) return NULL;
    if (each > r->each) {
        free(r->buffers);
        r->buffers = NULL, r->each = 0;
        if (posix_memalign((void **)&r->buffers, PAGE, (size_t)(each * r->entries)) != 0) return NULL;
        r->each = each;
    }
    return r;
}

static tally_t read_uring(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst) {
    tally_t out = {0, 0};
    int64_t a = t->reader->align, each = a > 0 ? (t->rb + 2 * a - 1) & ~(a - 1) : 0;
    ring_t *r = ring_for(each);
    if (r == NULL) return read_threads(t, misses, n, dst);
    unsigned depth = (unsigned)(t->reader->depth < (int)r->entries ? t->reader->depth : (int)r->entries);
    unsigned slots[MAX_DEPTH], free_slots = 0, inflight = 0, queued = 0;
    for (unsigned s = 0; s < depth; s++) slots[free_slots++] = s;
    int64_t next = 0, done = 0, skips[MAX_DEPTH];
    while (done < n) {
        unsigned tail = *r->sq_tail;
        while (next < n && free_slots) {
            unsigned slot = slots[--free_slots];
            int64_t offset, start, len, skip;
            int fd = row_at(t, misses[next].id, &offset);
            span(t, offset, &start, &len, &skip);
            struct io_uring_sqe *e = &r->sqes[tail & *r->sq_mask];
            memset(e, 0, sizeof *e);
            e->opcode = IORING_OP_READ;
            e->fd = fd;
            e->off = (uint64_t)start;
            e->addr = (uint64_t)(uintptr_t)(a > 0 ? r->buffers + slot * each : dst + misses[next].pos * t->rb);
            e->len = (unsigned)len;
            e->user_data = (uint64_t)next << 16 | slot;
            skips[slot] = skip;
            r->sq_array[tail & *r->sq_mask] = tail & *r->sq_mask;
            tail++, next++, queued++, inflight++;
        }
        __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        int rc = (int)syscall(__NR_io_uring_enter, r->fd, queued, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (rc < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
            /* the ring stopped working: what it did not take is read by pread, from `next` on */
            for (; next < n; next++) read_one(t, &misses[next], dst, bounce(each ? each : 1), &out);
            if (inflight == 0) break;
        } else if (rc > 0) {
            queued -= (unsigned)rc < queued ? (unsigned)rc : queued;
        }
        unsigned head = *r->cq_head;
        while (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
            int64_t i = (int64_t)(c->user_data >> 16);
            unsigned slot = (unsigned)(c->user_data & 0xFFFF);
            int64_t offset, start, len, skip;
            row_at(t, misses[i].id, &offset);
            span(t, offset, &start, &len, &skip);
            const uint8_t *buf = a > 0 ? r->buffers + slot * each : dst + misses[i].pos * t->rb;
            if (!(a <= 0 && c->res == len)) settle(t, &misses[i], dst, buf, skips[slot], c->res, len, &out);
            head++, done++, inflight--;
            slots[free_slots++] = slot;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    return out;
}
#endif

/* A forked child has only the thread that forked: no reader threads, every lock free. That thread's
 * ring is the parent's too (the same io_uring instance, the same mapped queues): the child lets go
 * of it and makes its own on its next read. */
static void after_fork_in_child(void) {
    r_jobs = NULL, r_threads = 0;
    pthread_mutex_init(&r_mu, NULL);
    pthread_cond_init(&r_cv, NULL);
#ifdef HAVE_URING
    if (t_ring_state == 1) {
        ring_unmake(&t_ring, t_ring.fd);
        free(t_ring.buffers);
    }
    t_ring_state = 0;
#endif
}

__attribute__((constructor)) static void hook_fork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

tally_t ple_read_misses(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst, int64_t *counts) {
    long t0 = now_ns();
    tally_t out = {0, 0};
    int strategy = t->reader ? t->reader->strategy : READ_FAULT;
    if (strategy == READ_FAULT) {
        for (int64_t j = 0; j < n; j++) memcpy(dst + misses[j].pos * t->rb, misses[j].mapped, (size_t)t->rb);
        return out;
    }
#ifdef HAVE_URING
    if (strategy == READ_URING) out = read_uring(t, misses, n, dst);
    else
#endif
        out = read_threads(t, misses, n, dst);
    count(counts, C_FILE_READS, n);
    count(counts, C_READ_NS, now_ns() - t0);
    return out;
}

int ple_resident(const uint8_t *row, int64_t rb) {
    uintptr_t first = (uintptr_t)row & ~(uintptr_t)(PAGE - 1), last = ((uintptr_t)row + (uintptr_t)rb - 1) & ~(uintptr_t)(PAGE - 1);
    unsigned char vec[2] = {0, 0};
    size_t pages = last > first ? 2 : 1;
    if (mincore((void *)first, pages * PAGE, vec) != 0) return 0;
    return (vec[0] & 1) && (pages == 1 || (vec[1] & 1));
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

/* Whether this build reads with io_uring and this kernel lets it make a ring (1), or not (0). */
int ple_uring_works(void) {
#ifdef HAVE_URING
    ring_t probe;
    if (ring_make(&probe, 8) != 0) return 0;
    ring_unmake(&probe, probe.fd);
    return 1;
#else
    return 0;
#endif
}
