/* The pool: worker threads that split a big lookup (rowcopy.h says what the files do).
 *
 * One pooled lookup at a time in the process: ple_run_pooled holds g_call from the job's posting to
 * its end (one thread, inside one ple_lookup_run). Blocks are claimed with a compare-and-swap on one word holding
 * (job number << 32 | next block), so a worker that wakes late can never claim a block of another
 * job than the one it read. A job's descriptor (one of two, by job number) is rewritten only two
 * jobs later, after the job in between ended, by when every block of this one was copied. The
 * calling thread copies blocks too while it waits, so a lookup completes even with no worker
 * running (none could be started, or the process was forked). */
#include "rowcopy.h"

#define MAX_BLOCKS 65536

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

static void copy_block(job_t *j, uint32_t i) {
    int64_t a = (int64_t)i * j->block;
    int64_t b = a + j->block < j->q->n ? a + j->block : j->q->n;
    tally_t n = ple_run_rows(j->q, a, b);
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

/* A forked child has only the thread that forked: none of the workers, and locks other threads held
 * stay held. No thread of the child is inside a lookup (a thread inside ple_lookup_run cannot fork),
 * so every lock starts free and the child's lookups are copied by their calling threads. */
static void after_fork_in_child(void) {
    atomic_store(&g_workers, 0);
    pthread_mutex_init(&g_call, NULL);
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_cv, NULL);
    pthread_mutex_init(&g_start, NULL);
}

__attribute__((constructor)) static void hook_fork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

int ple_pool_running(void) { return atomic_load(&g_workers) > 0; }

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
tally_t ple_run_pooled(const ple_lookup_t *q) {
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

