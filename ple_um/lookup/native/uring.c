/* The reader's reads through io_uring (reader.c says what the reader does; rowcopy.h what the files
 * do and what nothing here may do).
 *
 * One ring per reading thread, made on first use and let go when the thread ends; up to `depth`
 * reads queued at once, each completion settled as it comes (reader.c's ple_read_rest: a short or
 * failed read finished by pread). Every result of io_uring_enter is taken, and nothing waits with
 * nothing in flight:
 * - EINTR: called again (what the kernel took before the signal stays taken: the queue's head says);
 * - EAGAIN, EBUSY: what completed is settled, and the call made again after a pause, growing; after
 *   STALLS_BUSY in a row with nothing done, the ring is given up;
 * - any other error (ENOMEM, ...): the ring is given up.
 * Given up: the table's reader says why (reader->failed) and reads by the reader threads from then
 * on; the reads the kernel had not taken are taken back and made by pread, the misses not yet
 * queued go to the reader threads, and the reads in the kernel's hands are waited for (it completes
 * them whatever its calls return now) before this thread lets go of its ring. A ring that cannot be
 * made or given its buffers is given up the same way, before any read.
 */
#include "reader.h"

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

#ifdef HAVE_URING
#define STALLS_BUSY 20   /* EAGAIN or EBUSY with nothing done, in a row (pauses of 1 us to 1 ms: ~10 ms) */
#define STALLS_EMPTY 1000 /* EINTR, or a return with nothing done, in a row */

typedef struct {
    int fd;
    unsigned entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    uint8_t *buffers; /* entries bounce buffers of `each` bytes */
    int64_t each;
    void *maps[2];
    size_t map_bytes[2];
} ring_t;

static __thread ring_t t_ring;
static __thread int t_ring_made;
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

/* 0, or -errno. */
static int ring_make(ring_t *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) return -errno;
    size_t sq_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_bytes = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (cq_bytes > sq_bytes) sq_bytes = cq_bytes;
    uint8_t *sq = mmap(NULL, sq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    int err = sq == MAP_FAILED ? errno : 0;
    void *sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (sqes == MAP_FAILED && err == 0) err = errno;
    r->maps[0] = sq, r->maps[1] = sqes;
    r->map_bytes[0] = sq_bytes, r->map_bytes[1] = p.sq_entries * sizeof(struct io_uring_sqe);
    if (err == 0 && !(p.features & IORING_FEAT_SINGLE_MMAP)) err = EOPNOTSUPP;
    if (err) {
        ring_unmake(r, fd);
        return -err;
    }
    r->fd = fd, r->entries = p.sq_entries;
    r->sq_head = (unsigned *)(sq + p.sq_off.head), r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask), r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(sq + p.cq_off.head), r->cq_tail = (unsigned *)(sq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(sq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(sq + p.cq_off.cqes);
    r->sqes = sqes;
    r->buffers = NULL, r->each = 0;
    return 0;
}

static void ring_drop(void) {
    if (t_ring_made) {
        ring_unmake(&t_ring, t_ring.fd);
        free(t_ring.buffers);
        (void)pthread_setspecific(ring_key, NULL);
    }
    t_ring_made = 0;
}

static void ring_release(void *arg) {
    (void)arg;
    ring_drop();
}

static void ring_key_make(void) { (void)pthread_key_create(&ring_key, ring_release); }

/* This thread's ring with bounce buffers of `each` bytes, or NULL: the call that failed and errno. */
static ring_t *ring_for(int64_t each, int *call, int *err) {
    ring_t *r = &t_ring;
    if (!t_ring_made) {
        int rc = ring_make(r, MAX_DEPTH);
        if (rc < 0) {
            *call = RING_SETUP, *err = -rc;
            return NULL;
        }
        t_ring_made = 1;
        pthread_once(&ring_key_once, ring_key_make);
        (void)pthread_setspecific(ring_key, r);
    }
    if (each > r->each) {
        free(r->buffers);
        r->buffers = NULL, r->each = 0;
        int rc = posix_memalign((void **)&r->buffers, PAGE, (size_t)each * r->entries);
        if (rc != 0) {
            r->buffers = NULL;
            *call = RING_MEMORY, *err = rc;
            return NULL;
        }
        r->each = each;
    }
    return r;
}

/* One lookup's misses read through a ring. */
typedef struct {
    const ple_rows_t *t;
    ring_t *r;
    ple_miss_t *misses;
    uint8_t *dst;
    int64_t each, n, next, done; /* misses queued, misses settled */
    unsigned tail, free_slots, slots[MAX_DEPTH];
    tally_t out;
} batch_t;

static uint8_t *slot_buffer(const batch_t *b, unsigned slot, int64_t i) {
    return b->each > 0 ? b->r->buffers + (int64_t)slot * b->each : b->dst + b->misses[i].pos * b->t->rb;
}

/* Reads of the next misses queued while slots are free (the kernel takes them at the next enter). */
static void queue(batch_t *b) {
    ring_t *r = b->r;
    while (b->next < b->n && b->free_slots) {
        unsigned slot = b->slots[--b->free_slots], at = b->tail & *r->sq_mask;
        int64_t offset, start, len, skip, i = b->next++;
        int fd = row_at(b->t, b->misses[i].id, &offset);
        span(b->t, offset, &start, &len, &skip);
        struct io_uring_sqe *e = &r->sqes[at];
        memset(e, 0, sizeof *e);
        e->opcode = IORING_OP_READ;
        e->fd = fd;
        e->off = (uint64_t)start;
        e->addr = (uint64_t)(uintptr_t)slot_buffer(b, slot, i);
        e->len = (uint32_t)len;
        e->user_data = (uint64_t)i << 16 | slot;
        r->sq_array[at] = at;
        b->tail++;
    }
    __atomic_store_n(r->sq_tail, b->tail, __ATOMIC_RELEASE);
}

/* The completed reads settled; how many. */
static int64_t reap(batch_t *b) {
    ring_t *r = b->r;
    unsigned head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    int64_t got = 0;
    for (; head != tail; head++, got++) {
        const struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
        int64_t i = (int64_t)(c->user_data >> 16);
        unsigned slot = (unsigned)(c->user_data & 0xFFFF);
        if (b->each > 0 || c->res != b->t->rb)
            ple_read_rest(b->t, &b->misses[i], b->dst, slot_buffer(b, slot, i), c->res, &b->out);
        b->slots[b->free_slots++] = slot;
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    b->done += got;
    return got;
}

static void nap(long ns) {
    struct timespec d = {0, ns};
    nanosleep(&d, NULL);
}

/* The ring failed with `err` (the module comment says what follows). */
static void give_up(batch_t *b, int err) {
    ring_t *r = b->r;
    ple_ring_failed(b->t, RING_ENTER, err);
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    for (unsigned k = head; k != b->tail; k++) { /* queued, not taken by the kernel: taken back */
        const struct io_uring_sqe *e = &r->sqes[r->sq_array[k & *r->sq_mask]];
        ple_read_one(b->t, &b->misses[e->user_data >> 16], b->dst, &b->out);
        b->slots[b->free_slots++] = (unsigned)(e->user_data & 0xFFFF);
        b->done++;
    }
    b->tail = head;
    __atomic_store_n(r->sq_tail, head, __ATOMIC_RELEASE);
    if (b->next < b->n) {
        tally_add(&b->out, ple_read_threads(b->t, b->misses + b->next, b->n - b->next, b->dst));
        b->done += b->n - b->next;
        b->next = b->n;
    }
    while (b->done < b->n) /* what is left is in the kernel's hands: it completes */
        if (reap(b) == 0 && syscall(__NR_io_uring_enter, r->fd, 0, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0)
            nap(50000);
    ring_drop();
}

tally_t ple_read_uring(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst) {
    int64_t a = t->reader->align, each = a > 0 ? (t->rb + 2 * a - 1) & ~(a - 1) : 0;
    int call = 0, err = 0;
    ring_t *r = ring_for(each, &call, &err);
    if (r == NULL) {
        ple_ring_failed(t, call, err);
        return ple_read_threads(t, misses, n, dst);
    }
    batch_t b = {.t = t, .r = r, .misses = misses, .dst = dst, .each = each, .n = n, .tail = *r->sq_tail};
    unsigned depth = t->reader->depth < 1 ? 1 : (unsigned)t->reader->depth;
    for (unsigned s = 0; s < depth && s < r->entries && s < MAX_DEPTH; s++) b.slots[b.free_slots++] = s;
    int stalls = 0;
    while (b.done < n) {
        queue(&b);
        unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        /* Something is in flight here (done < n: a read queued or in the kernel's hands), so waiting
         * for one completion ends; where the kernel takes only part of the queue it does not wait. */
        int rc = (int)syscall(__NR_io_uring_enter, r->fd, b.tail - head, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        int e = rc < 0 ? errno : 0;
        if (e != 0 && e != EINTR && e != EAGAIN && e != EBUSY) {
            give_up(&b, e);
            break;
        }
        int moved = reap(&b) > 0 || __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE) != head;
        if (moved) {
            stalls = 0;
        } else if (e == EAGAIN || e == EBUSY) {
            if (++stalls >= STALLS_BUSY) {
                give_up(&b, e);
                break;
            }
            nap(1000L << (stalls < 10 ? stalls : 10));
        } else if (++stalls > STALLS_EMPTY) {
            give_up(&b, e);
            break;
        }
    }
    return b.out;
}

/* A forked child has only the thread that forked. That thread's ring is the parent's too (the same
 * io_uring instance, the same mapped queues): the child lets go of it and makes its own on its next
 * read. */
static void after_fork_in_child(void) { ring_drop(); }

__attribute__((constructor)) static void hook_fork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

/* Whether this build reads with io_uring and this kernel lets it make a ring (1), or not (0). */
int ple_uring_works(void) {
    ring_t probe;
    if (ring_make(&probe, 8) != 0) return 0;
    ring_unmake(&probe, probe.fd);
    return 1;
}

#else /* no <linux/io_uring.h>: every ring "fails" to be made; ple_uring_works says no first */
tally_t ple_read_uring(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst) {
    ple_ring_failed(t, RING_SETUP, ENOSYS);
    return ple_read_threads(t, misses, n, dst);
}

int ple_uring_works(void) { return 0; }
#endif
