/* The row cache: hot rows kept at row granularity in memory the table owns (rowcopy.h says what the
 * files do and what nothing here may do).
 *
 * Set-associative: an id hashes to one set of WAYS slots, and only those are searched and replaced.
 * Rows that hash to a set beyond its ways stay out even when the cache has room: with sets of 16,
 * hot rows filling 40% of the slots leave about 1 in 12 000 of them out (sets of 8: 1 in 400).
 *
 * Memory (rowcopy.h's comment states the bytes a slot takes): a set's tags are one 64-byte line of
 * WAYS 32-bit words (a slot's tag is its id + 1, 0 for an empty slot: exact, no filter to check
 * behind it); a set's head (16 bytes: its version, CLOCK's hand, its policy word of a 4-bit field
 * per way) lies in a dense array of its own; the rows lie one after the other with nothing between
 * them. So a hit reads the set's tags, its head and the row. Ids that a tag cannot hold (negative,
 * or past TAG_MOST - 1) are never held: their rows are read each time, and no table of fewer than
 * 2^32 - 1 rows has one.
 *
 * Publishing: a set's version is odd while one of its slots is written, and taking it odd (a compare
 * and swap from even) is the writer's lock (a writer that finds it odd or loses the swap offers its
 * row to nobody: the cache is only a cache). The writer makes the version odd, then writes the tag
 * and the row's bytes, then makes the version even again (a release store). A reader reads the
 * version, then the tag, copies the bytes, and takes the copy only when the version is the same even
 * number after it. So a row's bytes are in place before anything can find them, and a set written
 * while a lookup copies one of its rows is a miss for that lookup, never a torn or foreign row.
 *
 * Policies (policy): POLICY_TINYLFU admits a missed row only when its estimated frequency is above
 * that of the row it would evict, the victim being the set's row of the lowest frequency: one-off
 * rows then never flush hot ones. A held row's frequency is its 4-bit field of the set's policy
 * word: the estimate it was admitted with, raised by each hit (saturating at 15). A row not held is
 * estimated from its misses: a doorkeeper bit (the id missed in the current period) plus a
 * count-min sketch of 4-bit counters of the ids that missed more than once (4 rows of counters in a
 * 64-byte block, raised by conservative update: only the counters at the minimum). So a hit touches
 * nothing but its set and its row. Counts fade: every AGE_EVERY accesses one set's policy word and
 * the sketch's share of one set are halved, in turn, so all of them age once in AGE_EVERY x sets
 * accesses (15 x the cache's slots), and the doorkeeper's shares of DOOR_SWEEPS sets are cleared:
 * it forgets four times as fast. Its 16 bits a slot (two an id) kept as long as the counts would
 * fill up and let one-off rows into the sketch (docs/lab/PERF_NOTES.md measures it). POLICY_LRU
 * evicts the set's least recently used slot (the policy word holds each way's rank, a permutation
 * of 0..15; host/row_cache.py starts way w at rank w) and admits every row; POLICY_CLOCK gives each
 * slot a second chance (a bit a way). docs/TRAFFIC.md compares the policies on a serving trace, and
 * scripts/profile_cold.py --parts policies measures this cache's. Readers update a set's policy
 * word without a lock: a word written by two at once keeps one's, which only makes the policy less
 * exact (every word stored is a whole valid word).
 *
 * A follower (an NVFP4 table's block scales, looked up for the same ids right after its rows) has
 * slots for its rows' bytes and nothing else: the tags, heads, sketch and doorkeeper are those of
 * the cache it follows, whose slot k's id its slot k holds the part of once written (a bit a way in
 * the set's head, set by the follower's put, cleared when the followed cache writes the slot; both
 * write under the set's one version). So the two hold the same ids, and the policy sees each
 * access once.
 *
 * Speed: a hit is bound by the memory it reads, not by its instructions, so a hit reads few cache
 * lines (the set's tags and head, the row; a miss also reads the id's four counters, which share one
 * 64-byte block of the sketch, and its doorkeeper word), lookups ask for them some ids ahead
 * (ple_cache_prefetch), and no access takes a locked instruction of its own (the access count, aging
 * and counters are taken a window of ids at once), which would hold back the reads after it.
 */
#include "rowcache.h"
#include "sanitize.h"

#include <sched.h>

enum { POLICY_TINYLFU, POLICY_LRU, POLICY_CLOCK };
#define SKETCH_ROWS 4
#define SATURATE 15     /* a 4-bit counter's and a held row's count at most */
#define AGE_EVERY 240   /* accesses per set aged: counts fade over 15 x the cache's slots */
#define DOOR_SWEEPS 4   /* the doorkeeper is cleared this many times as often as the counts fade */
#define NIBBLES 0x1111111111111111ULL

#ifdef PLE_TEST_COUNT_HASHES
int64_t ple_test_hashes_taken;
int64_t ple_test_hashes(void) { return __atomic_load_n(&ple_test_hashes_taken, __ATOMIC_RELAXED); }
#endif

int64_t ple_cache_struct_size(void) { return (int64_t)sizeof(struct ple_cache); }
int64_t ple_cache_ways(void) { return WAYS; }
int64_t ple_cache_set_head(void) { return (int64_t)sizeof(struct set_head); }

/* A place in [0, n) for a 64-bit hash, by a multiply. */
static inline uint64_t place(uint64_t x, int64_t n) { return (uint64_t)(((unsigned __int128)x * (uint64_t)n) >> 64); }

static inline uint64_t load_policy(const struct set_head *s) { return __atomic_load_n(&s->policy, __ATOMIC_RELAXED); }
static inline void store_policy(struct set_head *s, uint64_t v) { __atomic_store_n(&s->policy, v, __ATOMIC_RELAXED); }
static inline uint32_t field(uint64_t word, int w) { return (uint32_t)(word >> (4 * w)) & 15; }
static inline uint64_t with_field(uint64_t word, int w, uint32_t v) {
    return (word & ~(15ULL << (4 * w))) | (uint64_t)v << (4 * w);
}

/* LRU: way w used now. Its rank becomes 0 and every rank below its old one moves up by one: the
 * word stays a permutation of 0..15. The fields are compared eight at a time in bytes. */
static inline uint64_t lru_touch(uint64_t word, int w) {
    uint64_t r = field(word, w) * 0x0101010101010101ULL, low = 0x0f0f0f0f0f0f0f0fULL, top = 0x8080808080808080ULL;
    uint64_t even = word & low, odd = (word >> 4) & low;
    even += (~((even | top) - r) & top) >> 7; /* +1 where the rank is below r */
    odd += (~((odd | top) - r) & top) >> 7;
    return with_field(even | odd << 4, w, 0);
}

/* The doorkeeper's word of the id of hash h, and its two bits there (one cache line an access). */
static inline uint64_t *door_word(const ple_cache_t *c, uint64_t h, uint64_t *mask) {
    uint64_t g = mix(h ^ 0x5851f42d4c957f2dULL);
    *mask = 1ULL << (g >> 58) | 1ULL << ((g >> 52) & 63);
    return &c->door[place(g << 12, c->door_words)];
}

/* The doorkeeper: whether an id was seen this period (its bits set now when `set`, and returned as
 * they were). The bits are set without a locked instruction: two lookups that set bits
 * of one word at once may lose one's, which costs that id one more sighting, never a wrong row. */
static int door_seen(ple_cache_t *c, uint64_t h, int set) {
    uint64_t mask, *word = door_word(c, h, &mask), v = __atomic_load_n(word, __ATOMIC_RELAXED);
    if ((v & mask) == mask) return 1;
    if (set) __atomic_store_n(word, v | mask, __ATOMIC_RELAXED);
    return 0;
}

/* The sketch's block of the id of hash h: 64 bytes (one cache line), SKETCH_ROWS rows of 32 4-bit
 * counters; the id's counter of row r is the one of number (*g >> 5r) & 31 in that row's 16 bytes. */
static inline uint8_t *sketch_block(const ple_cache_t *c, uint64_t h, uint64_t *g) {
    uint64_t x = mix(h + 0x9e3779b97f4a7c15ULL);
    *g = x;
    return c->sketch + (place(x << 20, c->sketch_blocks) << 6);
}

static inline int counter_get(const uint8_t *block, uint64_t g, int r, uint8_t **at, int *shift) {
    uint32_t i = (uint32_t)(g >> (5 * r)) & 31;
    *at = (uint8_t *)block + 16 * r + (i >> 1);
    *shift = 4 * (int)(i & 1);
    return (__atomic_load_n(*at, __ATOMIC_RELAXED) >> *shift) & 15;
}

static int sketch_min(const uint8_t *block, uint64_t g) {
    int best = SATURATE, shift;
    uint8_t *at;
    for (int r = 0; r < SKETCH_ROWS; r++) {
        int v = counter_get(block, g, r, &at, &shift);
        if (v < best) best = v;
    }
    return best;
}

/* The part [n * j / parts, n * (j + 1) / parts) of n things. */
static inline void share(int64_t n, int64_t parts, int64_t j, int64_t *from, int64_t *to) {
    *from = (int64_t)((unsigned __int128)n * (uint64_t)j / (uint64_t)parts);
    *to = (int64_t)((unsigned __int128)n * (uint64_t)(j + 1) / (uint64_t)parts);
}

/* One step of TINYLFU's aging (the step of number `at`): one set's counts halved, and that set's
 * share of the sketch (its counters halved) and DOOR_SWEEPS sets' shares of the doorkeeper
 * (cleared), in turn. */
static void age_step(ple_cache_t *c, uint64_t at) {
    int64_t j = (int64_t)(at % (uint64_t)c->sets), from, to;
    struct set_head *s = head_of(c, j);
    store_policy(s, (load_policy(s) >> 1) & (0x7 * NIBBLES));
    share(c->sketch_blocks * 64, c->sets, j, &from, &to);
    for (int64_t b = from; b < to; b++)
        __atomic_store_n(c->sketch + b, (uint8_t)((__atomic_load_n(c->sketch + b, __ATOMIC_RELAXED) >> 1) & 0x77),
                         __ATOMIC_RELAXED);
    for (uint64_t q = 0; q < DOOR_SWEEPS; q++) {
        share(c->door_words, c->sets, (int64_t)((at * DOOR_SWEEPS + q) % (uint64_t)c->sets), &from, &to);
        for (int64_t w = from; w < to; w++) __atomic_store_n(&c->door[w], 0, __ATOMIC_RELAXED);
    }
}

/* n accesses of the cache counted (TINYLFU's aging), a window of ids at once: one locked
 * instruction a window instead of one an access (each is a full fence on x86, which would keep the
 * accesses' memory reads from overlapping). The aging steps those n accesses are due are taken here. */
void ple_cache_accesses(ple_cache_t *c, int64_t n) {
    if (c->follower) return; /* its sets age with the cache it follows */
    uint64_t first = __atomic_fetch_add(&c->clock[0], (uint64_t)n, __ATOMIC_RELAXED);
    if (c->policy == POLICY_TINYLFU)
        for (uint64_t at = (first + AGE_EVERY - 1) / AGE_EVERY; at * AGE_EVERY < first + (uint64_t)n; at++)
            age_step(c, at);
}

/* Hits and misses counted into the table's counters, a window's at once. */
void ple_cache_count(ple_cache_t *c, int64_t hits, int64_t misses) {
    count(c->counts, C_CACHE_HITS, hits);
    count(c->counts, C_CACHE_MISSES, misses);
}

/* One miss of the id of hash h, counted for its admission; returns its estimate, this miss
 * included: the sketch's count plus its doorkeeper bit, at most SATURATE. */
static int sketch_add(ple_cache_t *c, uint64_t h) {
    int seen = door_seen(c, h, 1); /* a first sighting only sets the doorkeeper */
    uint64_t g;
    uint8_t *block = sketch_block(c, h, &g);
    int low = sketch_min(block, g);
    if (seen && low < SATURATE) {
        for (int r = 0; r < SKETCH_ROWS; r++) { /* conservative update: only the counters at the minimum */
            uint8_t *at;
            int shift;
            if (counter_get(block, g, r, &at, &shift) == low) {
                uint8_t b = __atomic_load_n(at, __ATOMIC_RELAXED);
                __atomic_store_n(at, (uint8_t)((b & ~(15 << shift)) | (low + 1) << shift), __ATOMIC_RELAXED);
            }
        }
        low++;
    }
    return low + 1 < SATURATE ? low + 1 : SATURATE; /* the doorkeeper's bit is set now */
}

/* Ask for the memory a get of the id of hash h (ple_cache_hash) will look at first (its set's tags
 * and head) without waiting for it: a lookup calls this for ids ahead of the one it serves, so that
 * the get finds them in the CPU's caches. */
void ple_cache_prefetch(const ple_cache_t *c, uint64_t h) {
    int64_t set = set_of(c, h);
    __builtin_prefetch(c->tags + set * WAYS, 0, 3);
    __builtin_prefetch(head_of(c, set), 0, 3);
}

/* Ask for the rows of the slots whose tag is that of `id` (of hash h), without waiting for them,
 * and return their ways (a bit a way) for its get: called once the set's tags are at hand
 * (ple_cache_prefetch some ids before). A hint only: the get checks each slot it names. */
uint32_t ple_cache_prefetch_row(const ple_cache_t *c, int64_t id, uint64_t h) {
    uint32_t tag = tag_for(id);
    if (tag == 0) return 0;
    int64_t set = set_of(c, h);
    uint32_t ways = ways_of(c, set, tag);
    for (uint32_t left = ways; left; left &= left - 1)
        prefetch_bytes(row_of(c, set * WAYS + __builtin_ctz(left)), c->rb);
    return ways;
}

/* The row of `id` (of hash h: ple_cache_hash) copied to dst (1), or 0 when the cache does not
 * hold it: looked for in the slots of `ways` (ple_cache_prefetch_row's; a slot written since is
 * checked like any other, and a row put since in another slot is a miss). The caller counts the hit
 * or miss (ple_cache_count), and offers the row of a miss once read (ple_cache_put).
 */
int ple_cache_get(ple_cache_t *c, int64_t id, uint64_t h, uint32_t ways, uint8_t *dst) {
    uint32_t tag = tag_for(id);
    if (!ways || tag == 0) return 0;
    int64_t set = set_of(c, h);
    struct set_head *s = head_of(c, set);
    uint32_t before = __atomic_load_n(&s->version, __ATOMIC_ACQUIRE);
    if (before & 1) return 0;
    for (; ways; ways &= ways - 1) {
        int w = __builtin_ctz(ways);
        int64_t k = set * WAYS + w;
        if (__atomic_load_n(c->tags + k, __ATOMIC_RELAXED) != tag) continue;
        if (c->follower && !(__atomic_load_n(&s->follows, __ATOMIC_RELAXED) >> w & 1)) return 0;
        PLE_RACY_READS_BEGIN(); /* a sequence lock's copy: used only when the version held (sanitize.h) */
        memcpy(dst, row_of(c, k), (size_t)c->rb);
        PLE_RACY_READS_END();
        atomic_thread_fence(memory_order_acquire);
        if (__atomic_load_n(&s->version, __ATOMIC_RELAXED) != before) return 0;
        if (c->follower) return 1; /* the policy sees the access in the cache it follows */
        uint64_t word = load_policy(s);
        if (c->policy == POLICY_TINYLFU) {
            if (field(word, w) < SATURATE) store_policy(s, word + (1ULL << (4 * w)));
        } else if (c->policy == POLICY_LRU) {
            if (field(word, w) != 0) store_policy(s, lru_touch(word, w));
        } else if (field(word, w) == 0) {
            store_policy(s, with_field(word, w, 1));
        }
        return 1;
    }
    return 0;
}

/* The way of a full set the new row would take, or -1 to keep the set as it is (the caller holds
 * the set's version odd). */
static int choose(ple_cache_t *c, struct set_head *s, int estimate) {
    uint64_t word = load_policy(s);
    if (c->policy == POLICY_CLOCK) {
        for (int turn = 0; turn < 2 * WAYS; turn++) {
            int w = (int)(s->hand++ % WAYS);
            if (field(word, w) == 0) {
                store_policy(s, word);
                return w;
            }
            word = with_field(word, w, 0);
        }
        store_policy(s, word);
        return (int)(s->hand++ % WAYS);
    }
    int victim = 0;
    uint32_t low = field(word, 0);
    for (int w = 1; w < WAYS; w++) { /* LRU: the highest rank; TINYLFU: the lowest count */
        uint32_t f = field(word, w);
        if (c->policy == POLICY_LRU ? f > low : f < low) victim = w, low = f;
    }
    if (c->policy == POLICY_LRU) return victim;
    return (uint32_t)estimate > low ? victim : -1; /* TINYLFU: kept unless beaten */
}

/* The set's version taken odd (its writer's lock): 1, with the even version it had in *v, or 0 when
 * another writer holds it. */
static int lock_set(struct set_head *s, uint32_t *v) {
    *v = __atomic_load_n(&s->version, __ATOMIC_RELAXED);
    if ((*v & 1) || !__atomic_compare_exchange_n(&s->version, v, *v + 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        return 0;
    atomic_thread_fence(memory_order_release); /* the odd version before anything written after it */
    return 1;
}

/* A follower's put: the part of the row of `id` written into the slot whose tag is id's in the
 * cache it follows, when that cache holds the id and the slot lacks it; else nothing. */
static void follower_put(ple_cache_t *c, int64_t set, struct set_head *s, uint32_t tag, const uint8_t *row) {
    uint32_t v;
    if (!lock_set(s, &v)) return;
    uint32_t ways = ways_of(c, set, tag);
    int w = ways ? __builtin_ctz(ways) : 0;
    if (!ways || (s->follows >> w & 1)) { /* not held, or already whole: nothing written */
        __atomic_store_n(&s->version, v, __ATOMIC_RELEASE);
        return;
    }
    memcpy(row_of(c, set * WAYS + w), row, (size_t)c->rb);
    __atomic_store_n(&s->follows, (uint16_t)(s->follows | 1u << w), __ATOMIC_RELAXED);
    __atomic_store_n(&s->version, v + 2, __ATOMIC_RELEASE);
}

/* Offer the row of `id`, which the cache did not hold, just read (row: its bytes); the policy
 * decides whether it is kept (a follower's: whether the cache it follows holds the id). */
void ple_cache_put(ple_cache_t *c, int64_t id, const uint8_t *row) {
    uint32_t tag = tag_for(id), v;
    if (tag == 0) return;
    uint64_t h = ple_cache_hash(id);
    int64_t set = set_of(c, h);
    struct set_head *s = head_of(c, set);
    if (c->follower) {
        follower_put(c, set, s, tag, row);
        return;
    }
    int estimate = c->policy == POLICY_TINYLFU ? sketch_add(c, h) : 0;
    if (!lock_set(s, &v)) return;
    if (ways_of(c, set, tag)) { /* put meanwhile by another lookup: nothing written */
        __atomic_store_n(&s->version, v, __ATOMIC_RELEASE);
        return;
    }
    uint32_t empty = ways_of(c, set, 0);
    int w = empty ? __builtin_ctz(empty) : choose(c, s, estimate);
    if (w < 0) {
        __atomic_store_n(&s->version, v, __ATOMIC_RELEASE);
        return;
    }
    int64_t k = set * WAYS + w;
    uint64_t word = load_policy(s);
    store_policy(s, c->policy == POLICY_LRU       ? lru_touch(word, w)
                    : c->policy == POLICY_TINYLFU ? with_field(word, w, (uint32_t)estimate)
                                                  : with_field(word, w, 1));
    /* the follower's part of the slot is stale from here on */
    __atomic_store_n(&s->follows, (uint16_t)(s->follows & ~(1u << w)), __ATOMIC_RELAXED);
    __atomic_store_n(c->tags + k, tag, __ATOMIC_RELAXED);
#ifdef PLE_TEST_PUBLISH_FIRST /* a wrong cache, built by tests/lookup/test_cold_rows.py alone */
    __atomic_store_n(&s->version, v + 2, __ATOMIC_RELEASE); /* even before the bytes are in place */
    for (int spin = 0; spin < 200; spin++) sched_yield();   /* a reader may find it meanwhile */
    memcpy(row_of(c, k), row, (size_t)c->rb);
#else
    memcpy(row_of(c, k), row, (size_t)c->rb);
    __atomic_store_n(&s->version, v + 2, __ATOMIC_RELEASE); /* even: published */
#endif
    count(c->counts, C_CACHE_INSERTS, 1);
    count(c->counts, C_CACHE_EVICTIONS, !empty);
}

/* Where the cache holds the rows of ids[0..n): slots[i] = the slot of ids[i] (its row lies at
 * data + slot * rb), or -1 where no slot holds it whole (a set being written counts as not held).
 * Returns how many were found. Read-only: no row is read, and neither the policy nor the counters
 * change. For a reader of the slots other than the row copy (tools/slot_reads.py: a GPU kernel
 * reading them through registered memory); nothing keeps a slot found from being rewritten after. */
int64_t ple_cache_find(const ple_cache_t *c, const int64_t *ids, int64_t n, int64_t *slots) {
    enum { FIND_AHEAD = 16 }; /* ids ahead whose set is asked for (a power of two) */
    uint64_t hash[FIND_AHEAD]; /* the hashes of ids i .. i + FIND_AHEAD - 1, at their index mod FIND_AHEAD */
    int64_t found = 0;
    for (int64_t i = 0; i < n && i < FIND_AHEAD; i++) {
        hash[i] = ple_cache_hash(ids[i]); /* each id hashed once: asked for, then looked in */
        ple_cache_prefetch(c, hash[i]);
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t set = set_of(c, hash[i % FIND_AHEAD]);
        if (i + FIND_AHEAD < n) {
            hash[i % FIND_AHEAD] = ple_cache_hash(ids[i + FIND_AHEAD]);
            ple_cache_prefetch(c, hash[i % FIND_AHEAD]);
        }
        uint32_t tag = tag_for(ids[i]), ways = 0;
        const struct set_head *s = head_of(c, set);
        uint32_t before = __atomic_load_n(&s->version, __ATOMIC_ACQUIRE);
        if (tag != 0 && !(before & 1)) ways = ways_of(c, set, tag);
        if (ways && c->follower) ways &= __atomic_load_n(&s->follows, __ATOMIC_RELAXED);
        atomic_thread_fence(memory_order_acquire);
        if (__atomic_load_n(&s->version, __ATOMIC_RELAXED) != before) ways = 0;
        slots[i] = ways ? set * WAYS + __builtin_ctz(ways) : -1;
        found += ways != 0;
    }
    return found;
}
