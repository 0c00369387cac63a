/* The host gather's row copy: one lookup's rows read from the mapped shard files into a staging
 * buffer, by id, in batch order. ple_um/lookup/rowcopy.py loads it with ctypes (no Python headers).
 *
 * ple_lookup_run(lookup) is the whole of a lookup's host work. It is a CUDA host function: a captured
 * lookup queues it with cuLaunchHostFunc between the copy that brings the ids into pinned memory
 * and the copy that takes the staged rows to the device, so it runs on a driver thread, in stream
 * order, in CUDA graphs like any node. Eager lookups are run by the dispatcher thread below instead,
 * signalled through words of pinned memory. It therefore never calls CUDA, never needs the GIL
 * and never fails: an id outside the owned range gives a zero row; an id outside the table gives a
 * zero row and is counted; an owned id whose row lies outside its shard's mapped rows (a broken shard
 * map) gives a zero row and is counted as broken. On a machine without CUDA the same function is
 * called directly (ctypes releases the GIL for the call).
 *
 * While it copies row i, a thread prefetches row i + AHEAD, so many rows' TLB and cache misses are in
 * flight per core (torch.index_select copies row by row: about one). Small lookups are copied by the
 * calling thread alone; bigger ones are split into blocks that a pool of worker threads, which stays
 * up between lookups, claims in order, the calling thread copying blocks too.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#define MAX_BLOCKS 65536
#define AHEAD 16

/* One table's rows as a lookup reads them: the rows of a MappedTable, or an NVFP4 table's block
 * scales. Shard s holds ids [s * per_shard, (s + 1) * per_shard); its local row r lies at
 * bases[s] + r * rb, and its local rows [first[s], end[s]) are mapped (first = end: none). Ids in
 * [lo, hi) are owned. The arrays belong to the caller and outlive every lookup that uses them. */
typedef struct {
    int64_t shards, per_shard, num_rows, lo, hi, rb;
    const uint64_t *bases;
    const int64_t *first;
    const int64_t *end;
} ple_rows_t;

/* Counters a lookup adds to (atomically; several lookups may run at once). */
enum { C_ROWS, C_OUT_OF_TABLE, C_BROKEN, C_NS, C_LOOKUPS, C_COUNT };

/* One lookup: what cuLaunchHostFunc hands to ple_lookup_run. ids are of kind id_kind (0 int64,
 * 1 int32, 2 int16, 3 int8, 4 uint8). dst[k] receives n rows of tables[k] (tables[1] may be NULL).
 * With touch set, nothing is copied: one byte of every 4 KiB page of each owned row is read, so that
 * the pages are in memory before a GPU kernel reads the rows. busy is set by the caller when it
 * queues the lookup and cleared here, last, when the lookup is done. */
typedef struct ple_lookup {
    const ple_rows_t *tables[2];
    uint8_t *dst[2];
    const void *ids;
    int64_t n;
    int64_t *counts;
    int32_t id_kind;
    int32_t touch;
    int32_t threads; /* > 1: the pool may help */
    int32_t inline_rows; /* at most this many rows: the calling thread alone */
    atomic_int busy;
    /* Eager lookups through the dispatcher (below): it waits until *ready reaches seq (the
     * stream writes it once the ids are in pinned memory), copies, then sets *done to seq (the
     * stream's copy of the rows to the device waits for it). Unused by host nodes. */
    uint32_t seq;
    const volatile uint32_t *ready;
    volatile uint32_t *done;
    struct ple_lookup *next; /* the dispatcher's queue */
} ple_lookup_t;

static inline int64_t id_at(const ple_lookup_t *q, int64_t i) {
    switch (q->id_kind) {
    case 1: return ((const int32_t *)q->ids)[i];
    case 2: return ((const int16_t *)q->ids)[i];
    case 3: return ((const int8_t *)q->ids)[i];
    case 4: return ((const uint8_t *)q->ids)[i];
    default: return ((const int64_t *)q->ids)[i];
    }
}

static inline void prefetch_row(const uint8_t *p, int64_t rb) {
    for (int64_t k = 0; k < rb; k += 64) __builtin_prefetch(p + k, 0, 3);
    __builtin_prefetch(p + rb - 1, 0, 3);
}

/* Where the row of global id `id` lies: NULL when the id is not owned (a zero row), or, with
 * *broken set, when its row is outside its shard's row space. */
static inline const uint8_t *id_row(const ple_rows_t *t, int64_t id, int *broken) {
    if (id < t->lo || id >= t->hi) return NULL;
    int64_t s = id / t->per_shard; /* id >= lo >= 0 */
    int64_t r = id - s * t->per_shard;
    if (s >= t->shards || r < t->first[s] || r >= t->end[s]) {
        *broken = 1;
        return NULL;
    }
    return (const uint8_t *)(uintptr_t)(t->bases[s] + (uint64_t)r * (uint64_t)t->rb);
}

/* What a stretch of a lookup found: ids outside the table, owned ids with no row in their space. */
typedef struct {
    int64_t outside, broken;
} tally_t;

static inline void add(tally_t *to, tally_t from) { to->outside += from.outside, to->broken += from.broken; }

/* Rows [a, b) of one table of the lookup. */
static tally_t copy_table(const ple_lookup_t *q, int k, int64_t a, int64_t b) {
    const ple_rows_t *t = q->tables[k];
    uint8_t *dst = q->dst[k];
    int64_t rb = t->rb;
    tally_t n = {0, 0};
    int ignored = 0;
    const uint8_t *p;
    for (int64_t i = a; i < a + AHEAD && i < b; i++)
        if ((p = id_row(t, id_at(q, i), &ignored))) prefetch_row(p, rb);
    for (int64_t i = a; i < b; i++) {
        int64_t id = id_at(q, i);
        if (i + AHEAD < b && (p = id_row(t, id_at(q, i + AHEAD), &ignored))) prefetch_row(p, rb);
        int broken = 0;
        if ((p = id_row(t, id, &broken))) {
            memcpy(dst + i * rb, p, (size_t)rb);
        } else {
            memset(dst + i * rb, 0, (size_t)rb);
            n.broken += broken;
            n.outside += id < 0 || id >= t->num_rows;
        }
    }
    return n;
}

/* Read one byte of every page of each owned row [a, b) of the lookup's first table. */
static tally_t touch_rows(const ple_lookup_t *q, int64_t a, int64_t b) {
    const ple_rows_t *t = q->tables[0];
    tally_t n = {0, 0};
    volatile uint8_t sink = 0;
    for (int64_t i = a; i < b; i++) {
        int broken = 0;
        int64_t id = id_at(q, i);
        const uint8_t *p = id_row(t, id, &broken);
        n.broken += broken;
        if (!p) {
            n.outside += id < 0 || id >= t->num_rows;
            continue;
        }
        for (int64_t off = 0; off < t->rb; off += 4096 - (int64_t)((uintptr_t)(p + off) & 4095)) sink ^= p[off];
        sink ^= p[t->rb - 1];
    }
    (void)sink;
    return n;
}

/* Rows [a, b) of the lookup, every table; the tally counts the first table's (the rows') ids once. */
static tally_t run_rows(const ple_lookup_t *q, int64_t a, int64_t b) {
    if (q->touch) return touch_rows(q, a, b);
    tally_t n = copy_table(q, 0, a, b);
    if (q->tables[1]) n.broken += copy_table(q, 1, a, b).broken;
    return n;
}

/* ---- the pool ----------------------------------------------------------------------------
 * One pooled lookup at a time in the process: open_job takes g_call and close_job releases it (same
 * thread, inside one ple_lookup_run). Blocks are claimed with a compare-and-swap on one word holding
 * (job number << 32 | next block), so a worker that wakes late can never claim a block of another
 * job than the one it read. A job's descriptor (one of two, by job number) is rewritten only two
 * jobs later, after the job in between ended, by when every block of this one was copied. The
 * calling thread copies blocks too while it waits, so a lookup completes even with no worker
 * running (none could be started, or the process was forked). */

typedef struct {
    const ple_lookup_t *q;
    int64_t block;
    atomic_uint blocks; /* atomic: a worker two jobs behind may read it while it is rewritten */
    uint32_t waited;    /* the caller's cursor: blocks [0, waited) are known done */
    atomic_llong outside, broken;
    atomic_uchar done[MAX_BLOCKS];
} job_t;

static job_t g_jobs[2];
static _Atomic uint64_t g_claim;
static uint32_t g_gen;                                      /* the current job's number */
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER;  /* held while a pooled job runs */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;    /* sleeping workers */
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_start = PTHREAD_MUTEX_INITIALIZER; /* starting workers */
static atomic_int g_workers;
static atomic_long g_spin_ns;
static atomic_uint g_wake; /* bumped by ple_pool_wake: a lookup is coming */
#define WAKE_SPIN_NS 2000000L /* how long woken workers spin for the lookup that follows */
#define BLOCK_ROWS 256

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static void copy_block(job_t *j, uint32_t i) {
    int64_t a = (int64_t)i * j->block;
    int64_t b = a + j->block < j->q->n ? a + j->block : j->q->n;
    tally_t n = run_rows(j->q, a, b);
    if (n.outside) atomic_fetch_add(&j->outside, n.outside);
    if (n.broken) atomic_fetch_add(&j->broken, n.broken);
}

/* Claim and copy one block of the job `v` was read from; 0 when none is left to claim. */
static int copy_one(uint64_t v) {
    for (;;) {
        uint32_t gen = (uint32_t)(v >> 32), i = (uint32_t)v;
        job_t *j = &g_jobs[gen & 1];
        if (i >= atomic_load_explicit(&j->blocks, memory_order_relaxed)) return 0;
        if (atomic_compare_exchange_weak(&g_claim, &v, v + 1)) {
            copy_block(j, i);
            atomic_store_explicit(&j->done[i], 1, memory_order_release);
            return 1;
        }
        if ((uint32_t)(v >> 32) != gen) return 0;
    }
}

/* Spin, then sleep, until a job newer than `seen` is posted; a wake restarts the spin. */
static void wait_for_job(uint32_t seen) {
    long t0 = now_ns(), spin = atomic_load(&g_spin_ns);
    unsigned wake = atomic_load(&g_wake);
    while ((uint32_t)(atomic_load(&g_claim) >> 32) == seen) {
        if (atomic_load(&g_wake) != wake) {
            wake = atomic_load(&g_wake), t0 = now_ns(), spin = WAKE_SPIN_NS;
        } else if (now_ns() - t0 > spin) {
            pthread_mutex_lock(&g_mu);
            while ((uint32_t)(atomic_load(&g_claim) >> 32) == seen && atomic_load(&g_wake) == wake)
                pthread_cond_wait(&g_cv, &g_mu);
            pthread_mutex_unlock(&g_mu);
        } else {
            relax();
        }
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&g_claim) >> 32);
    for (;;) {
        wait_for_job(seen);
        uint64_t v = atomic_load(&g_claim);
        seen = (uint32_t)(v >> 32);
        while (copy_one(v)) {
            v = atomic_load(&g_claim);
            if ((uint32_t)(v >> 32) != seen) break;
        }
    }
    return NULL;
}

/* The dispatcher's queue (see "the dispatcher" below). */
static pthread_mutex_t d_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t d_cv = PTHREAD_COND_INITIALIZER;
static ple_lookup_t *d_head, *d_tail;
static int d_sleeping;
static atomic_int d_running;

/* A forked child has only the thread that forked: none of the workers, and locks other threads held
 * stay held. No thread of the child is inside a lookup (a thread inside ple_lookup_run cannot fork),
 * so every lock starts free and the child's lookups are copied by their calling threads. */
static void after_fork_in_child(void) {
    atomic_store(&g_workers, 0);
    atomic_store(&d_running, 0);
    d_head = d_tail = NULL, d_sleeping = 0;
    pthread_mutex_init(&d_mu, NULL);
    pthread_cond_init(&d_cv, NULL);
    pthread_mutex_init(&g_call, NULL);
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_cv, NULL);
    pthread_mutex_init(&g_start, NULL);
}

__attribute__((constructor)) static void hook_fork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

/* Start workers up to `workers` in all (threads are never stopped; the pool only grows); after a
 * job they spin `spin_ns` before sleeping. Returns the number of workers running. */
int ple_pool_start(int workers, long spin_ns) {
    pthread_mutex_lock(&g_start);
    atomic_store(&g_spin_ns, spin_ns);
    for (int k = atomic_load(&g_workers); k < workers; k++) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, NULL) != 0) break;
        pthread_detach(t);
        atomic_fetch_add(&g_workers, 1);
    }
    int running = atomic_load(&g_workers);
    pthread_mutex_unlock(&g_start);
    return running;
}

/* Wake sleeping workers to spin for a lookup about to come (their wake-up then overlaps the work
 * before it). Also a CUDA host function: the argument is ignored. */
void ple_pool_wake(void *unused) {
    (void)unused;
    atomic_fetch_add(&g_wake, 1);
    pthread_mutex_lock(&g_mu);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

/* The lookup's rows copied by the pool and the calling thread. */
static tally_t run_pooled(const ple_lookup_t *q) {
    int64_t block = BLOCK_ROWS;
    while (q->n / block + (q->n % block != 0) > MAX_BLOCKS) block *= 2;
    pthread_mutex_lock(&g_call);
    job_t *j = &g_jobs[++g_gen & 1];
    j->q = q, j->block = block, j->waited = 0;
    uint32_t blocks = (uint32_t)(q->n / block + (q->n % block != 0));
    atomic_store(&j->outside, 0);
    atomic_store(&j->broken, 0);
    for (uint32_t i = 0; i < blocks; i++) atomic_store_explicit(&j->done[i], 0, memory_order_relaxed);
    atomic_store_explicit(&j->blocks, blocks, memory_order_relaxed);
    atomic_store(&g_claim, (uint64_t)g_gen << 32);
    pthread_mutex_lock(&g_mu);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    while (j->waited < blocks) {
        if (atomic_load_explicit(&j->done[j->waited], memory_order_acquire)) j->waited++;
        else if (!copy_one(atomic_load(&g_claim))) relax();
    }
    tally_t n = {atomic_load(&j->outside), atomic_load(&j->broken)};
    pthread_mutex_unlock(&g_call);
    return n;
}

/* One lookup's rows and counters (all but its busy flag). */
static void run_lookup(ple_lookup_t *q) {
    long t0 = now_ns();
    tally_t n = {0, 0};
    if (q->n > 0) {
        if (q->threads > 1 && q->n > q->inline_rows && atomic_load(&g_workers) > 0) n = run_pooled(q);
        else n = run_rows(q, 0, q->n);
    }
    int64_t *c = q->counts;
    if (!q->touch) {
        __atomic_fetch_add(&c[C_ROWS], q->n, __ATOMIC_RELAXED);
        __atomic_fetch_add(&c[C_OUT_OF_TABLE], n.outside, __ATOMIC_RELAXED);
        __atomic_fetch_add(&c[C_LOOKUPS], 1, __ATOMIC_RELAXED);
    }
    if (n.broken) __atomic_fetch_add(&c[C_BROKEN], n.broken, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c[C_NS], now_ns() - t0, __ATOMIC_RELAXED);
}

/* The host function: the whole of one lookup's host work (see the top of this file). */
void ple_lookup_run(void *arg) {
    ple_lookup_t *q = (ple_lookup_t *)arg;
    run_lookup(q);
    atomic_store_explicit(&q->busy, 0, memory_order_release);
}

/* ---- the dispatcher ----------------------------------------------------------------------
 * Eager lookups on a CUDA device are posted here rather than queued as host nodes (host_node.py
 * says why): one thread per process runs each once its stream has written *ready >= seq (after the
 * ids' copy to pinned memory), then sets *done = seq and clears its busy flag; the stream's copy of
 * the rows waits for that with cuStreamWaitValue32. Comparisons are cyclic, as CUDA's are. Of the
 * jobs posted, the first (in the order posted) whose ids are in runs next: a job never waits for
 * one whose stream is behind, so no stream is held up by another's, and the chunks of one lookup,
 * posted together under one ready word, run in order. */

#define IDLE_SPIN_NS 200000L  /* the dispatcher spins this long for work before it sleeps or naps */
#define NAP_NS 20000L

static inline int reached(const volatile uint32_t *word, uint32_t seq) {
    return (int32_t)(__atomic_load_n(word, __ATOMIC_ACQUIRE) - seq) >= 0;
}

/* Move the posted jobs to the end of the dispatcher's own list; sleep for a post while both are
 * empty, after a spin. */
static void take_posted(ple_lookup_t **head, ple_lookup_t **tail) {
    long t0 = now_ns();
    if (!*head)
        while (!__atomic_load_n(&d_head, __ATOMIC_ACQUIRE) && now_ns() - t0 < IDLE_SPIN_NS) relax();
    if (!__atomic_load_n(&d_head, __ATOMIC_ACQUIRE) && *head) return;
    pthread_mutex_lock(&d_mu);
    while (!d_head && !*head) {
        d_sleeping = 1;
        pthread_cond_wait(&d_cv, &d_mu);
        d_sleeping = 0;
    }
    if (d_head) {
        if (*tail) (*tail)->next = d_head;
        else *head = d_head;
        *tail = d_tail;
        __atomic_store_n(&d_head, NULL, __ATOMIC_RELEASE);
        d_tail = NULL;
    }
    pthread_mutex_unlock(&d_mu);
}

static void *dispatcher(void *arg) {
    (void)arg;
    struct timespec nap = {0, NAP_NS};
#if defined(__linux__)
    prctl(PR_SET_TIMERSLACK, 1000UL); /* naps of NAP_NS, not NAP_NS + the default 50 us slack */
#endif
    ple_lookup_t *head = NULL, *tail = NULL; /* posted, not yet run */
    long idle_since = now_ns();
    for (;;) {
        take_posted(&head, &tail);
        ple_lookup_t *prev = NULL, *q = head;
        while (q && !reached(q->ready, q->seq)) prev = q, q = q->next;
        if (!q) { /* every job waits for its stream: spin a while, then nap */
            if (now_ns() - idle_since < IDLE_SPIN_NS) relax();
            else nanosleep(&nap, NULL);
            continue;
        }
        if (prev) prev->next = q->next;
        else head = q->next;
        if (tail == q) tail = prev;
        uint32_t seq = q->seq;
        volatile uint32_t *done = q->done;
        run_lookup(q);
        /* busy last: once it is clear the caller may refill the job or free the words (a closed
         * table), so nothing of the job is touched after it. */
        __atomic_store_n(done, seq, __ATOMIC_RELEASE);
        atomic_store_explicit(&q->busy, 0, memory_order_release);
        idle_since = now_ns();
    }
    return NULL;
}

/* Start the dispatcher once per process; 1 when it runs, 0 when it could not be started. A
 * forked child inherits no thread: until it calls this, its posts are refused (-1) and its
 * lookups take host nodes. */
int ple_dispatch_start(void) {
    pthread_mutex_lock(&g_start);
    if (!atomic_load(&d_running)) {
        pthread_t t;
        if (pthread_create(&t, NULL, dispatcher, NULL) == 0) {
            pthread_detach(t);
            atomic_store(&d_running, 1);
        }
    }
    pthread_mutex_unlock(&g_start);
    return atomic_load(&d_running);
}

/* Queue one job (its busy flag already set by the caller); 0 when queued, -1 when no dispatcher
 * runs (the caller takes a host node instead). */
int ple_dispatch_post(ple_lookup_t *q) {
    if (!atomic_load(&d_running)) return -1;
    q->next = NULL;
    pthread_mutex_lock(&d_mu);
    if (d_tail) d_tail->next = q;
    else __atomic_store_n(&d_head, q, __ATOMIC_RELEASE);
    d_tail = q;
    if (d_sleeping) pthread_cond_signal(&d_cv);
    pthread_mutex_unlock(&d_mu);
    return 0;
}

/* Sizes of the two structs, so that the ctypes declarations can be checked against them. */
int64_t ple_struct_sizes(void) { return (int64_t)sizeof(ple_rows_t) << 32 | (int64_t)sizeof(ple_lookup_t); }
