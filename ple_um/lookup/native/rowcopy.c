/* One lookup job: its rows, and who runs it (rowcopy.h says what the files do and what nothing
 * here may do).
 *
 * ple_run_lookup(job) is the whole of a lookup's host work, run one of three ways:
 *  - as a CUDA host function, ple_lookup_run: a captured lookup queues it with cuLaunchHostFunc
 *    between the copy that brings the ids into pinned memory and the copy that takes the staged
 *    rows to the device, so it runs on a driver thread, in stream order, in CUDA graphs like any
 *    node (eager lookups too where the dispatcher is not used);
 *  - by the dispatcher thread (at the end of this file): eager lookups on a CUDA device, posted
 *    with ple_dispatch_post and run once their stream has signalled that their ids are in;
 *  - called directly, ple_lookup_run again, on a machine without CUDA (ctypes releases the GIL).
 * A big lookup is split in blocks over the worker pool (pool.c) whichever runs it.
 *
 * Rows in memory: while it copies row i, a thread prefetches row i + AHEAD, so many rows' TLB and
 * cache misses are in flight per core (torch.index_select copies row by row: about one).
 * A table with a row cache or a reader takes the other path: a window of ids at a time, the rows
 * the cache holds copied from it, the others collected and read from the files together
 * (reader.c), then offered to the cache.
 */
#include "rowcopy.h"

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#define AHEAD 16
#define WINDOW 512 /* ids a table with a cache or a reader looks at before it reads their misses */
#define CACHE_AHEAD 16 /* ids ahead whose cache memory is asked for (their slot's bytes at half that) */
_Static_assert(PLE_CACHE_WAYS <= 16, "copy_cold keeps a place's cache ways in 16 bits");

static inline int64_t id_at(const ple_lookup_t *q, int64_t i) {
    switch (q->id_kind) {
    case 1: return ((const int32_t *)q->ids)[i];
    case 2: return ((const int16_t *)q->ids)[i];
    case 3: return ((const int8_t *)q->ids)[i];
    case 4: return ((const uint8_t *)q->ids)[i];
    default: return ((const int64_t *)q->ids)[i];
    }
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

/* Rows [a, b) of one table, every row copied from the mapping (in memory, or faulted in). */
static tally_t copy_mapped(const ple_lookup_t *q, const ple_rows_t *t, uint8_t *dst, int64_t a, int64_t b) {
    int64_t rb = t->rb;
    tally_t n = {0, 0};
    int ignored = 0;
    const uint8_t *p;
    for (int64_t i = a; i < a + AHEAD && i < b; i++)
        if ((p = id_row(t, id_at(q, i), &ignored))) prefetch_bytes(p, rb);
    for (int64_t i = a; i < b; i++) {
        int64_t id = id_at(q, i);
        if (i + AHEAD < b && (p = id_row(t, id_at(q, i + AHEAD), &ignored))) prefetch_bytes(p, rb);
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

/* The window's ids read so far: the slot of an id in the open-addressed `seen` (2 * WINDOW entries
 * of index into `places` + 1; 0 = empty). */
static inline int64_t *seen_slot(int64_t *seen, const ple_miss_t *places, int64_t id) {
    uint64_t h = (uint64_t)id * 0x9e3779b97f4a7c15ULL;
    for (uint64_t k = h >> 54;; k = (k + 1) & (2 * WINDOW - 1)) /* 2 * WINDOW = 1024 = 2^10 */
        if (seen[k] == 0 || places[seen[k] - 1].id == id) return &seen[k];
}

/* Rows [a, b) of a table with a row cache or a reader, a window at a time. Each owned place is a
 * lookup of the cache of its own (the cache's memory asked for some places ahead); the places it
 * does not serve are read, each id once a window: an id's first such place is read (reader.c;
 * without a cache, copied from the mapping where its pages are resident), its later ones filled
 * from it. Then the rows read are offered to the cache. A hit so costs no bookkeeping of the
 * window's ids. */
static tally_t copy_cold(const ple_lookup_t *q, const ple_rows_t *t, uint8_t *dst, int64_t a, int64_t b) {
    int64_t rb = t->rb;
    tally_t n = {0, 0};
    ple_cache_t *cache = t->cache;
    ple_miss_t places[WINDOW];  /* the window's owned places */
    ple_miss_t rows[WINDOW];    /* the places read (one per id), in place marked unread on failure */
    int16_t read_as[WINDOW];    /* per first place of an id not served: its index in rows */
    uint64_t hash[WINDOW];      /* per owned place: its id's cache hash (ple_cache_hash), with a cache */
    uint16_t ways[WINDOW];      /* per owned place: the cache's ways to look in (ple_cache_prefetch_row) */
    int64_t seen[2 * WINDOW], again[WINDOW][2]; /* again: (place, index in places of its id's first) */
    for (int64_t w = a; w < b; w += WINDOW) {
        int64_t e = w + WINDOW < b ? w + WINDOW : b, d = 0, m = 0, r = 0, hits = 0;
        for (int64_t i = w; i < e; i++) {
            int64_t id = id_at(q, i);
            int broken = 0;
            const uint8_t *p = id_row(t, id, &broken);
            if (!p) {
                memset(dst + i * rb, 0, (size_t)rb);
                n.broken += broken;
                n.outside += id < 0 || id >= t->num_rows;
                continue;
            }
            if (cache) hash[d] = ple_cache_hash(id);
            places[d++] = (ple_miss_t){i, id, p};
        }
        if (cache) { /* the first places' cache memory asked for here, the others' CACHE_AHEAD ahead */
            ple_cache_accesses(cache, d);
            for (int64_t j = 0; j < d && j < CACHE_AHEAD; j++) ple_cache_prefetch(cache, hash[j]);
            for (int64_t j = 0; j < d && j < CACHE_AHEAD / 2; j++)
                ways[j] = (uint16_t)ple_cache_prefetch_row(cache, places[j].id, hash[j]);
        }
        int cleared = 0; /* seen[] is cleared once a window has a place the cache did not serve */
        for (int64_t j = 0; j < d; j++) {
            const ple_miss_t *at = &places[j];
            if (cache) {
                if (j + CACHE_AHEAD < d) ple_cache_prefetch(cache, hash[j + CACHE_AHEAD]);
                if (j + CACHE_AHEAD / 2 < d) {
                    const ple_miss_t *ahead = &places[j + CACHE_AHEAD / 2];
                    ways[j + CACHE_AHEAD / 2] = (uint16_t)ple_cache_prefetch_row(cache, ahead->id, hash[j + CACHE_AHEAD / 2]);
                }
                if (ple_cache_get(cache, at->id, hash[j], ways[j], dst + at->pos * rb)) {
                    hits++;
                    continue;
                }
            }
            if (!cleared) memset(seen, 0, sizeof seen), cleared = 1;
            int64_t *slot = seen_slot(seen, places, at->id);
            if (*slot) {
                again[r][0] = at->pos, again[r][1] = *slot - 1, r++;
                continue;
            }
            *slot = j + 1;
            read_as[j] = (int16_t)m, rows[m++] = *at;
        }
        if (m) tally_add(&n, ple_read_misses(t, rows, m, dst, q->counts));
        for (int64_t k = 0; k < r; k++) { /* an id's later places, from its first */
            int64_t to = again[k][0], first = again[k][1];
            if (rows[read_as[first]].mapped) memcpy(dst + to * rb, dst + places[first].pos * rb, (size_t)rb);
            else memset(dst + to * rb, 0, (size_t)rb), n.broken++;
        }
        if (cache) {
            ple_cache_count(cache, hits, d - hits);
            for (int64_t k = 0; k < m; k++)
                if (rows[k].mapped) ple_cache_put(cache, rows[k].id, dst + rows[k].pos * rb);
        }
    }
    return n;
}

static tally_t copy_table(const ple_lookup_t *q, int k, int64_t a, int64_t b) {
    const ple_rows_t *t = q->tables[k];
    if (t->cache == NULL && (t->reader == NULL || t->reader->strategy == READ_FAULT))
        return copy_mapped(q, t, q->dst[k], a, b);
    return copy_cold(q, t, q->dst[k], a, b);
}

/* Bring every page of each owned row [a, b) of table t into memory. With a reader, the pages not
 * resident are asked for together first (reader.c). */
static tally_t touch_table(const ple_lookup_t *q, const ple_rows_t *t, int64_t a, int64_t b) {
    tally_t n = {0, 0};
    ple_miss_t rows[WINDOW];
    volatile uint8_t sink = 0;
    for (int64_t w = a; w < b; w += WINDOW) {
        int64_t e = w + WINDOW < b ? w + WINDOW : b, m = 0;
        for (int64_t i = w; i < e; i++) {
            int broken = 0;
            int64_t id = id_at(q, i);
            const uint8_t *p = id_row(t, id, &broken);
            n.broken += broken;
            if (!p) {
                n.outside += id < 0 || id >= t->num_rows;
                continue;
            }
            rows[m++] = (ple_miss_t){i, id, p};
        }
        if (t->reader && t->reader->strategy != READ_FAULT) ple_touch_pages(t, rows, m);
        for (int64_t j = 0; j < m; j++) {
            const uint8_t *p = rows[j].mapped;
            for (int64_t off = 0; off < t->rb; off += 4096 - (int64_t)((uintptr_t)(p + off) & 4095))
                sink ^= p[off];
            sink ^= p[t->rb - 1];
        }
    }
    (void)sink;
    return n;
}

/* The touch of rows [a, b) of every table the kernel reads (the rows, a block-scaled table's block
 * scales); the tally counts the rows' ids once, as a copy does. */
static tally_t touch_rows(const ple_lookup_t *q, int64_t a, int64_t b) {
    tally_t n = touch_table(q, q->tables[0], a, b);
    if (q->tables[1]) n.broken += touch_table(q, q->tables[1], a, b).broken;
    return n;
}

/* Rows [a, b) of the lookup, every table; the tally counts the first table's (the rows') ids once. */
tally_t ple_run_rows(const ple_lookup_t *q, int64_t a, int64_t b) {
    if (q->touch) return touch_rows(q, a, b);
    tally_t n = copy_table(q, 0, a, b);
    if (q->tables[1]) n.broken += copy_table(q, 1, a, b).broken;
    return n;
}

/* One lookup's rows and counters (all but its busy flag). A live touch whose word is clear does
 * nothing and counts nothing. */
void ple_run_lookup(ple_lookup_t *q) {
    if (q->touch && q->live && !__atomic_load_n(q->live, __ATOMIC_ACQUIRE)) return;
    long t0 = now_ns();
    tally_t n = {0, 0};
    if (q->n > 0) {
        if (q->threads > 1 && q->n > q->inline_rows && ple_pool_running()) n = ple_run_pooled(q);
        else n = ple_run_rows(q, 0, q->n);
    }
    int64_t *c = q->counts;
    if (!q->touch) {
        count(c, C_ROWS, q->n);
        count(c, C_OUT_OF_TABLE, n.outside);
        count(c, C_LOOKUPS, q->chunk == 0);
    } else {
        count(c, C_TOUCHES, 1);
    }
    count(c, C_BROKEN, n.broken);
    count(c, C_NS, now_ns() - t0);
}

/* The host function: the whole of one lookup's host work. */
void ple_lookup_run(void *arg) {
    ple_lookup_t *q = (ple_lookup_t *)arg;
    ple_run_lookup(q);
    atomic_store_explicit(&q->busy, 0, memory_order_release);
}

/* The dispatcher: the one thread per process that runs eager lookups. Eager lookups on a CUDA
 * device are posted here rather than queued as host nodes (ple_um/lookup/host/gather.py says why):
 * it runs each once its stream has written *ready >= seq (after the ids' copy to pinned memory),
 * then sets *done = seq and clears its busy flag; the stream's copy of the rows waits for that with
 * cuStreamWaitValue32. Comparisons are cyclic, as CUDA's are. Of the jobs posted, the first (in the
 * order posted) whose ids are in runs next: a job never waits for one whose stream is behind, so no
 * stream is held up by another's, and the chunks of one lookup, posted together under one ready
 * word, run in order.
 */
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

/* Sizes of the structs the ctypes declarations must match: ple_rows_t, ple_lookup_t, ple_reader_t,
 * ple_cache_t, in 16 bits each. */
int64_t ple_struct_sizes(void) {
    extern int64_t ple_cache_struct_size(void);
    return (int64_t)sizeof(ple_rows_t) << 48 | (int64_t)sizeof(ple_lookup_t) << 32 |
           (int64_t)sizeof(ple_reader_t) << 16 | ple_cache_struct_size();
}
