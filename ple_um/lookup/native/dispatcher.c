/* The dispatcher: the one thread per process that runs eager lookups (rowcopy.h says what the
 * files do). Eager lookups on a CUDA device are posted here rather than queued as host nodes
 * (ple_um/lookup/host/gather.py says why): one thread per process runs each once its stream has written *ready >= seq (after the
 * ids' copy to pinned memory), then sets *done = seq and clears its busy flag; the stream's copy of
 * the rows waits for that with cuStreamWaitValue32. Comparisons are cyclic, as CUDA's are. Of the
 * jobs posted, the first (in the order posted) whose ids are in runs next: a job never waits for
 * one whose stream is behind, so no stream is held up by another's, and the chunks of one lookup,
 * posted together under one ready word, run in order. */
#include "rowcopy.h"

#if defined(__linux__)
#include <sys/prctl.h>
#endif

static pthread_mutex_t d_mu = PTHREAD_MUTEX_INITIALIZER; /* the posted jobs */
static pthread_cond_t d_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t d_start = PTHREAD_MUTEX_INITIALIZER;
static ple_lookup_t *d_head, *d_tail;
static int d_sleeping;
static atomic_int d_running;

/* A forked child has only the thread that forked: no dispatcher, and its locks start free (no
 * thread of the child is inside one). Until it starts a dispatcher of its own, its posts are
 * refused and its eager lookups take host nodes. */
static void after_fork_in_child(void) {
    atomic_store(&d_running, 0);
    d_head = d_tail = NULL, d_sleeping = 0;
    pthread_mutex_init(&d_mu, NULL);
    pthread_cond_init(&d_cv, NULL);
    pthread_mutex_init(&d_start, NULL);
}

__attribute__((constructor)) static void hook_fork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

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
        ple_run_lookup(q);
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
    pthread_mutex_lock(&d_start);
    if (!atomic_load(&d_running)) {
        pthread_t t;
        if (pthread_create(&t, NULL, dispatcher, NULL) == 0) {
            pthread_detach(t);
            atomic_store(&d_running, 1);
        }
    }
    pthread_mutex_unlock(&d_start);
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

