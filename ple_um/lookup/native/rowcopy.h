/* The host gather's C side, shared by its files: a lookup's rows read from the mapped shard files
 * into a staging buffer, by id, in batch order. ple_um/lookup/rowcopy.py compiles the files into
 * one library and loads it with ctypes (no Python headers).
 *
 *   rowcopy.c     one lookup job: its rows, and who runs it (ple_lookup_run, the host function
 *                 and the direct call; the dispatcher, the thread that runs eager lookups,
 *                 signalled through pinned memory)
 *   pool.c        the worker threads that split a big lookup
 *   rowcache.c    hot rows kept at row granularity in memory the table owns
 *   reader.c      rows not in memory read from the files many at a time (uring.c: through io_uring)
 *
 * Everything here runs where Python cannot: in a CUDA host node on a driver thread, on the
 * dispatcher's thread, on pool workers. So nothing calls CUDA, nothing needs the GIL and nothing
 * fails: an id outside the owned range gives a zero row; an id outside the table gives a zero row
 * and is counted; an owned id whose row lies outside its shard's mapped rows (a broken shard map)
 * gives a zero row and is counted as broken; a read from a file that fails (an I/O error, a file
 * shorter than its header said) gives a zero row and is counted as broken.
 */
#ifndef PLE_ROWCOPY_H
#define PLE_ROWCOPY_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* Counters a lookup adds to (atomically; several lookups may run at once). */
enum {
    C_ROWS,         /* ids looked up */
    C_OUT_OF_TABLE, /* ids outside [0, num_rows) */
    C_BROKEN,       /* owned ids whose row could not be had: zero rows */
    C_NS,           /* nanoseconds spent in lookups */
    C_LOOKUPS,      /* lookups run (a lookup cut in chunks: once) */
    C_CACHE_HITS,   /* rows served by the row cache */
    C_CACHE_MISSES, /* owned rows the row cache did not hold */
    C_CACHE_INSERTS,
    C_CACHE_EVICTIONS,
    C_FILE_READS, /* rows read from the files by the reader (not faulted in through the mapping) */
    C_READ_NS,    /* nanoseconds spent waiting for those reads */
    C_TOUCHES,    /* page touches run (a live touch whose word was clear is not) */
    C_COUNT
};

/* A row cache (rowcache.c). A slot takes its row's bytes and 8 bytes beside them at most: its
 * tag (4: the id + 1), its share of its set's head (16 bytes a set: 1), of the admission sketch
 * (1: two 4-bit counters) and of the doorkeeper (2: 16 bits), each array rounded up to 64 bytes
 * (host/row_cache.py sizes them: SLOT_OVERHEAD, nbytes_for). A follower cache (an NVFP4 table's
 * block scales, in slots matching its rows' cache's) takes its rows' bytes and nothing beside. */
typedef struct ple_cache ple_cache_t;
#define PLE_CACHE_WAYS 16 /* a row cache's slots per set: a set's ways fit 16 bits (rowcopy.c's ways[]) */

/* How the rows a lookup finds missing are read (reader.c). */
enum { READ_FAULT, READ_URING, READ_THREADS };
/* Where a table's ring failed (ple_reader_t.failed: call << 16 | errno). */
enum { RING_SETUP = 1, RING_ENTER = 2, RING_MEMORY = 3 };

typedef struct {
    const int32_t *fds;     /* per shard: the descriptor its rows are read through (-1: none) */
    const int64_t *offsets; /* per shard: the file offset of its local row 0 */
    int32_t align;          /* > 0: O_DIRECT reads of whole blocks of this many bytes; 0: plain reads */
    int32_t strategy;       /* READ_URING, READ_THREADS, or READ_FAULT (through the mapping) */
    int32_t depth;          /* reads in flight per reading thread */
    int32_t resident_check; /* rows without a cache: those whose pages are resident are copied */
    int32_t *failed;        /* READ_URING: 0, or where the ring failed (call << 16 | errno), set once by
                               reader.c; from then on the misses are read by the reader threads */
} ple_reader_t;

/* One table's rows as a lookup reads them: the rows of a MappedTable, or an NVFP4 table's block
 * scales. Shard s holds ids [s * per_shard, (s + 1) * per_shard); its local row r lies at
 * bases[s] + r * rb, and its local rows [first[s], end[s]) are mapped (first = end: none). Ids in
 * [lo, hi) are owned. With a cache, rows are looked up there first; with a reader, the rows found
 * missing are read from the files many at a time rather than faulted in one by one. The arrays,
 * the cache and the reader belong to the caller and outlive every lookup that uses them. */
typedef struct {
    int64_t shards, per_shard, num_rows, lo, hi, rb;
    const uint64_t *bases;
    const int64_t *first;
    const int64_t *end;
    ple_cache_t *cache;
    const ple_reader_t *reader;
} ple_rows_t;

/* One lookup: what cuLaunchHostFunc hands to ple_lookup_run. ids are of kind id_kind (0 int64,
 * 1 int32, 2 int16, 3 int8, 4 uint8). dst[k] receives n rows of tables[k] (tables[1] may be NULL).
 * With touch set, nothing is copied: every 4 KiB page of each owned row of each table is brought
 * into memory, so that the pages are there before a GPU kernel reads the rows (and block scales);
 * with live set too, only while *live is non-zero when the job runs (a word its table writes as
 * its residency changes: a graph's replays follow it). busy is set by the caller when it queues
 * the lookup and cleared here, last, when the lookup is done. */
typedef struct ple_lookup {
    const ple_rows_t *tables[2];
    uint8_t *dst[2];
    const void *ids;
    int64_t n;
    int64_t *counts;
    const volatile int32_t *live;
    int32_t id_kind;
    int32_t touch;
    int32_t threads;     /* > 1: the pool may help */
    int32_t inline_rows; /* at most this many rows: the calling thread alone */
    int32_t chunk;       /* > 0: a later chunk of a lookup cut in several (counted by its chunk 0) */
    atomic_int busy;
    /* Eager lookups through the dispatcher: it waits until *ready reaches seq (the stream writes it
     * once the ids are in pinned memory), copies, then sets *done to seq (the stream's copy of the
     * rows to the device waits for it). Unused by host nodes. */
    uint32_t seq;
    const volatile uint32_t *ready;
    volatile uint32_t *done;
    struct ple_lookup *next; /* the dispatcher's queue */
} ple_lookup_t;

/* What a stretch of a lookup found: ids outside the table, owned ids with no row to give. */
typedef struct {
    int64_t outside, broken;
} tally_t;

static inline void tally_add(tally_t *to, tally_t from) {
    to->outside += from.outside;
    to->broken += from.broken;
}

static inline long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline uint64_t mix(uint64_t x) { /* splitmix64's finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

#ifdef PLE_TEST_COUNT_HASHES /* a build of tests/lookup/test_cache_find.py alone: hashes counted */
extern int64_t ple_test_hashes_taken;
#endif

/* The row cache's hash of an id (its set, sketch block and doorkeeper word all come from it): a
 * lookup takes it once per distinct id and hands it to each cache call about that id. */
static inline uint64_t ple_cache_hash(int64_t id) {
#ifdef PLE_TEST_COUNT_HASHES
    __atomic_fetch_add(&ple_test_hashes_taken, 1, __ATOMIC_RELAXED);
#endif
    return mix((uint64_t)id);
}

/* Ask for every cache line of the n bytes at p, without waiting for them (a hint: nothing faults). */
static inline void prefetch_bytes(const uint8_t *p, int64_t n) {
    for (int64_t k = 0; k < n; k += 64) __builtin_prefetch(p + k, 0, 3);
    __builtin_prefetch(p + n - 1, 0, 3);
}

/* A pause in a spin loop: the core lets its sibling thread run and waits a little before the next
 * load. On aarch64 `isb` rather than `yield`: yield is a no-op on most Arm cores (Neoverse among
 * them), isb waits for the pipeline to drain (Rust's spin_loop and MySQL chose it for that). */
static inline void relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("isb" ::: "memory");
#endif
}

static inline void count(int64_t *counts, int which, int64_t n) {
    if (n) __atomic_fetch_add(&counts[which], n, __ATOMIC_RELAXED);
}

/* rowcopy.c */
tally_t ple_run_rows(const ple_lookup_t *q, int64_t a, int64_t b);
void ple_run_lookup(ple_lookup_t *q);
/* pool.c */
tally_t ple_run_pooled(const ple_lookup_t *q);
int ple_pool_running(void);
/* rowcache.c: a hit copies the row to dst and returns 1 (h: ple_cache_hash(id); ways: what
 * prefetch_row returned for it); put offers a row just read; accesses counts a window's accesses
 * (the policy's aging); the caller counts hits and misses; prefetch and prefetch_row ask for what a
 * get will read, some ids ahead. */
void ple_cache_accesses(ple_cache_t *c, int64_t n);
int ple_cache_get(ple_cache_t *c, int64_t id, uint64_t h, uint32_t ways, uint8_t *dst);
void ple_cache_put(ple_cache_t *c, int64_t id, const uint8_t *row);
void ple_cache_count(ple_cache_t *c, int64_t hits, int64_t misses);
void ple_cache_prefetch(const ple_cache_t *c, uint64_t h);
uint32_t ple_cache_prefetch_row(const ple_cache_t *c, int64_t id, uint64_t h);
/* rowcache.c: each id's slot (its row at the cache's data + slot * rb) or -1; read-only */
int64_t ple_cache_find(const ple_cache_t *c, const int64_t *ids, int64_t n, int64_t *slots);
/* reader.c: the rows of misses[0..n) (each an id and its position in the lookup) read into dst rows
 * (a table without a cache and with resident_check: those whose pages are resident copied from the
 * mapping); the tally counts the rows that could not be had (zeroed, their miss's mapped = NULL). */
typedef struct {
    int64_t pos; /* position in the lookup: where in dst the row goes */
    int64_t id;
    const uint8_t *mapped; /* the row's address in the mapping */
} ple_miss_t;
tally_t ple_read_misses(const ple_rows_t *t, ple_miss_t *misses, int64_t n, uint8_t *dst, int64_t *counts);
/* A table's reader holds the reader threads while it is open; the last one let go stops them. */
void ple_reader_hold(void);
void ple_reader_release(void);
void ple_touch_pages(const ple_rows_t *t, const ple_miss_t *rows, int64_t n);
int ple_resident(const uint8_t *row, int64_t rb);

#endif
