/* Row copy for the host bulk gather (ple_um/lookup/rowcopy.py loads it with ctypes, which
 * releases the GIL for each call; no Python headers).
 *
 * dst[i] = row rows[i] of the row table of i's segment. While it copies row i, a thread prefetches
 * row i + ahead, so many rows' TLB and cache misses are in flight per core instead of about one
 * (torch.index_select copies row by row through a generic copy routine). A job's rows come in
 * segments, one per row table (one per mapped file); a pool of worker threads that stays up
 * between jobs copies them in blocks, claimed in order, and the caller can wait for a prefix of
 * the rows while the rest are copied, to queue the host-to-device copy of each finished chunk.
 * A row number outside its table is not read: the row is zeroed and counted as an error.
 *
 * A job by id (ple_job_begin_ids) takes the lookup's ids in batch order instead: each id's shard
 * and row are worked out here, as the GPU kernel does, so the rows land where they belong and no
 * plan groups them by file first. Ids outside the owned range give zero rows; an owned id whose
 * row falls outside its shard's mapped rows (a broken mapping) is zeroed and counted as an error.
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

#define MAX_SEGMENTS 4096
#define MAX_BLOCKS 65536

static inline void prefetch_row(const uint8_t *p, int64_t rb) {
    for (int64_t k = 0; k < rb; k += 64) __builtin_prefetch(p + k, 0, 3);
    __builtin_prefetch(p + rb - 1, 0, 3);
}

/* Rows [a, b) of one segment; returns how many row numbers were outside [0, limit). */
static int64_t copy_range(const uint8_t *src, int64_t limit, int64_t rb, const int64_t *rows, int64_t a,
                          int64_t b, uint8_t *dst, int ahead) {
    int64_t bad = 0;
    for (int64_t i = a; i < a + ahead && i < b; i++)
        if ((uint64_t)rows[i] < (uint64_t)limit) prefetch_row(src + rows[i] * rb, rb);
    for (int64_t i = a; i < b; i++) {
        int64_t next = i + ahead;
        if (next < b && (uint64_t)rows[next] < (uint64_t)limit) prefetch_row(src + rows[next] * rb, rb);
        if ((uint64_t)rows[i] < (uint64_t)limit) {
            memcpy(dst + i * rb, src + rows[i] * rb, (size_t)rb);
        } else {
            memset(dst + i * rb, 0, (size_t)rb);
            bad++;
        }
    }
    return bad;
}

/* ---- the pool ----------------------------------------------------------------------------
 * One job at a time in the process: ple_job_begin takes the job lock and ple_job_end releases it
 * (same thread), so jobs of two tables never mix. Blocks are claimed with a compare-and-swap on
 * one word holding (job number << 32 | next block), so a worker that wakes late can never claim a
 * block of another job than the one it read. The job's descriptor (one of two, by job number) is
 * rewritten only two jobs later, after the job in between ended, by when every block of this one
 * was copied. The caller copies blocks too while it waits, so a job completes even with no
 * worker running (none could be started, or the process was forked). */

typedef struct {
    const uint8_t *base[MAX_SEGMENTS];
    int64_t limit[MAX_SEGMENTS]; /* rows in segment s's table */
    int64_t end[MAX_SEGMENTS];   /* segment s holds job rows [end[s-1], end[s]) */
    int segments;
    int64_t rb;
    const int64_t *rows;
    int64_t n;
    uint8_t *dst;
    int ahead;
    /* by id: rows[i] is a global id; segment s is shard s, base[s] its row space's row 0,
     * limit[s] that space's rows and row0[s] the row in it of the shard's local row 0 */
    int by_id;
    int64_t per_shard, lo, hi; /* rows per shard; the owned ids [lo, hi) */
    int64_t row0[MAX_SEGMENTS];
    atomic_int solo; /* the caller copies every block; the workers leave the job alone */
    int64_t block;
    atomic_uint blocks; /* atomic: a worker two jobs behind may read it while it is rewritten */
    uint32_t waited; /* the caller's cursor: blocks [0, waited) are known done */
    atomic_llong bad;
    atomic_uchar done[MAX_BLOCKS];
} job_t;

static job_t g_jobs[2];
static _Atomic uint64_t g_claim;
static uint32_t g_gen;                                      /* the current job's number */
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER;  /* held from begin to end */
static __thread int t_in_job; /* this thread holds g_call: its job is between begin and end */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;    /* sleeping workers */
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_start = PTHREAD_MUTEX_INITIALIZER; /* starting workers */
static int g_workers;
static atomic_long g_spin_ns;
static atomic_uint g_wake; /* bumped by ple_pool_wake: a job is coming */
#define WAKE_SPIN_NS 2000000L /* how long woken workers spin for the job that follows */

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

/* Where the row of global id `id` lies: NULL when the id is not owned (a zero row), or, with
 * *broken set, when its row is outside its shard's row space. */
static inline const uint8_t *id_row(const job_t *j, int64_t id, int *broken) {
    if (id < j->lo || id >= j->hi) return NULL;
    int64_t s = id / j->per_shard;
    /* Unsigned: exact whenever the row is in [0, 2^64), else at least 2^63, above every limit (a
     * negative row0 is valid: a shard owned from its row lo on) */
    uint64_t r;
    if (s >= j->segments || (r = (uint64_t)j->row0[s] + (uint64_t)(id - s * j->per_shard)) >= (uint64_t)j->limit[s]) {
        *broken = 1;
        return NULL;
    }
    return j->base[s] + (int64_t)r * j->rb;
}

/* Rows [a, b) of a job by id; returns how many owned ids had no row in their shard's space. */
static int64_t copy_ids(const job_t *j, int64_t a, int64_t b) {
    int64_t bad = 0, rb = j->rb;
    int ignored = 0;
    const uint8_t *p;
    for (int64_t i = a; i < a + j->ahead && i < b; i++)
        if ((p = id_row(j, j->rows[i], &ignored))) prefetch_row(p, rb);
    for (int64_t i = a; i < b; i++) {
        if (i + j->ahead < b && (p = id_row(j, j->rows[i + j->ahead], &ignored))) prefetch_row(p, rb);
        int broken = 0;
        if ((p = id_row(j, j->rows[i], &broken))) {
            memcpy(j->dst + i * rb, p, (size_t)rb);
        } else {
            memset(j->dst + i * rb, 0, (size_t)rb);
            bad += broken;
        }
    }
    return bad;
}

static void copy_block(job_t *j, uint32_t i) {
    int64_t a = (int64_t)i * j->block;
    int64_t b = a + j->block < j->n ? a + j->block : j->n;
    if (j->by_id) {
        int64_t bad = copy_ids(j, a, b);
        if (bad) atomic_fetch_add(&j->bad, bad);
        return;
    }
    int lo = 0, hi = j->segments - 1; /* the first segment that ends after row a */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (j->end[mid] <= a) lo = mid + 1;
        else hi = mid;
    }
    int64_t bad = 0;
    for (int s = lo; a < b; s++) {
        int64_t e = j->end[s] < b ? j->end[s] : b;
        bad += copy_range(j->base[s], j->limit[s], j->rb, j->rows, a, e, j->dst, j->ahead);
        a = e;
    }
    if (bad) atomic_fetch_add(&j->bad, bad);
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
        if (atomic_load_explicit(&g_jobs[seen & 1].solo, memory_order_relaxed)) continue;
        while (copy_one(v)) {
            v = atomic_load(&g_claim);
            if ((uint32_t)(v >> 32) != seen) break;
        }
    }
    return NULL;
}

/* A forked child has only the thread that forked: none of the workers, and locks that other
 * threads held stay held. If the forking thread was inside a job, the child keeps the job and its
 * lock, and its blocks not yet done are handed out again (a worker may have claimed one and died
 * with the parent's threads; copying a block twice writes the same bytes). A job of another
 * thread is dropped with its owner. */
static void after_fork_in_child(void) {
    g_workers = 0;
    pthread_mutex_init(&g_call, NULL);
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_cv, NULL);
    pthread_mutex_init(&g_start, NULL);
    if (t_in_job) {
        pthread_mutex_lock(&g_call);
        job_t *j = &g_jobs[g_gen & 1];
        uint32_t i = j->waited, blocks = atomic_load(&j->blocks);
        while (i < blocks && atomic_load(&j->done[i])) i++;
        atomic_store(&g_claim, ((uint64_t)g_gen << 32) | i);
    }
}

__attribute__((constructor)) static void hook_fork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }


/* Start workers up to `workers` in all (threads are never stopped; the pool only grows); after a
 * job they spin `spin_ns` before sleeping. Returns the number of workers running. */
int ple_pool_start(int workers, long spin_ns) {
    pthread_mutex_lock(&g_start);
    atomic_store(&g_spin_ns, spin_ns);
    for (int k = g_workers; k < workers; k++) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, NULL) != 0) break;
        pthread_detach(t);
        g_workers++;
    }
    int running = g_workers;
    pthread_mutex_unlock(&g_start);
    return running;
}

/* Wake sleeping workers to spin for a job about to be posted (their wake-up then overlaps the
 * caller's work before the job, not the job). */
void ple_pool_wake(void) {
    atomic_fetch_add(&g_wake, 1);
    pthread_mutex_lock(&g_mu);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

/* Take the job lock and the next job's descriptor; NULL when this thread is inside a job already
 * (it would wait for itself). */
static job_t *open_job(void) {
    if (t_in_job) return NULL;
    pthread_mutex_lock(&g_call);
    t_in_job = 1;
    return &g_jobs[++g_gen & 1];
}

/* Hand out the job `j` (filled in by the caller) to the pool, in blocks of `block` rows. */
static void post_job(job_t *j, const int64_t *rows, int64_t n, int64_t rb, uint8_t *dst, int ahead,
                     int64_t block, int solo) {
    j->rb = rb, j->rows = rows, j->n = n, j->dst = dst;
    j->ahead = ahead, j->block = block;
    atomic_store_explicit(&j->solo, solo, memory_order_relaxed);
    uint32_t blocks = (uint32_t)(n / block + (n % block != 0));
    atomic_store_explicit(&j->blocks, blocks, memory_order_relaxed);
    j->waited = 0;
    atomic_store(&j->bad, 0);
    for (uint32_t i = 0; i < blocks; i++) atomic_store_explicit(&j->done[i], 0, memory_order_relaxed);
    atomic_store(&g_claim, (uint64_t)g_gen << 32);
    if (!solo) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
}

static int too_many_blocks(int64_t n, int64_t block) {
    return n < 0 || block <= 0 || n / block + (n % block != 0) > MAX_BLOCKS;
}

/* Post a job: for segment s, dst[i] = row rows[i] of the table of limits[s] rows at bases[s], for
 * i in [ends[s-1], ends[s]) (ends[-1] = 0); with `solo`, only the caller copies. Takes the job
 * lock until ple_job_end. Returns -1 for arguments out of range and -2 when this thread is inside
 * a job already (it would wait for itself), taking nothing. */
int ple_job_begin(const uint64_t *bases, const int64_t *limits, const int64_t *ends, int segments, int64_t rb,
                  const int64_t *rows, uint8_t *dst, int ahead, int64_t block, int solo) {
    if (segments < 1 || segments > MAX_SEGMENTS || rb <= 0 || ahead < 0) return -1;
    int64_t n = ends[segments - 1];
    if (too_many_blocks(n, block)) return -1;
    for (int s = 0; s < segments; s++)
        if (ends[s] < (s ? ends[s - 1] : 0) || limits[s] < 0) return -1;
    job_t *j = open_job();
    if (!j) return -2;
    for (int s = 0; s < segments; s++) {
        j->base[s] = (const uint8_t *)(uintptr_t)bases[s];
        j->limit[s] = limits[s];
        j->end[s] = ends[s];
    }
    j->segments = segments, j->by_id = 0;
    post_job(j, rows, n, rb, dst, ahead, block, solo);
    return 0;
}

/* Post a job by id: dst[i] = the row of global id ids[i] for i in [0, n), zeros for ids outside
 * [lo, hi). Shard s holds ids [s * per_shard, (s + 1) * per_shard); its local row r is row
 * row0s[s] + r of the row space of limits[s] rows at bases[s] (limits[s] = 0: not mapped). The
 * rest as ple_job_begin. */
int ple_job_begin_ids(const uint64_t *bases, const int64_t *limits, const int64_t *row0s, int shards,
                      int64_t per_shard, int64_t lo, int64_t hi, int64_t rb, const int64_t *ids, int64_t n,
                      uint8_t *dst, int ahead, int64_t block, int solo) {
    if (shards < 1 || shards > MAX_SEGMENTS || per_shard < 1 || lo < 0 || hi < lo || rb <= 0 || ahead < 0)
        return -1;
    if (too_many_blocks(n, block)) return -1;
    for (int s = 0; s < shards; s++)
        if (limits[s] < 0) return -1;
    job_t *j = open_job();
    if (!j) return -2;
    for (int s = 0; s < shards; s++) {
        j->base[s] = (const uint8_t *)(uintptr_t)bases[s];
        j->limit[s] = limits[s];
        j->row0[s] = row0s[s];
    }
    j->segments = shards, j->by_id = 1, j->per_shard = per_shard, j->lo = lo, j->hi = hi;
    post_job(j, ids, n, rb, dst, ahead, block, solo);
    return 0;
}

/* Wait until rows [0, upto) of the current job are copied, copying blocks meanwhile. Only the
 * job's owner waits; another thread's call returns at once. */
void ple_job_wait(int64_t upto) {
    if (!t_in_job) return;
    job_t *j = &g_jobs[g_gen & 1];
    if (upto > j->n) upto = j->n;
    uint32_t need = upto > 0 ? (uint32_t)(upto / j->block + (upto % j->block != 0)) : 0;
    while (j->waited < need) {
        if (atomic_load_explicit(&j->done[j->waited], memory_order_acquire)) j->waited++;
        else if (!copy_one(atomic_load(&g_claim))) relax();
    }
}

/* If this thread is inside a job: wait for all of it, release the job lock and return the row
 * numbers found out of range; else -1 (so a caller can always call it, even not knowing whether
 * its begin took the lock). */
long long ple_job_end(void) {
    if (!t_in_job) return -1;
    job_t *j = &g_jobs[g_gen & 1];
    ple_job_wait(j->n);
    long long bad = atomic_load(&j->bad);
    t_in_job = 0;
    pthread_mutex_unlock(&g_call);
    return bad;
}
