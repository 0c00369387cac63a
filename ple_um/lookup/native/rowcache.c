/* The row cache: hot rows kept at row granularity in memory the table owns (rowcopy.h says what the
 * files do and what nothing here may do).
 *
 * Set-associative: an id hashes to one set of WAYS slots, and only those are searched and replaced.
 * Rows that hash to a set beyond its ways stay out even when the cache has room: with sets of 16,
 * hot rows filling 40% of the slots leave about 1 in 12 000 of them out (sets of 8: 1 in 400). A
 * set's fingerprints (one byte a slot, 0 for an empty one, from the id's hash) are two words of a
 * dense array, in one cache line; a slot is its head (the id it holds, or -1; a version; a policy
 * word) and then the row's bytes, so a hit reads the set's fingerprints and its slot, and a
 * fingerprint that matches by chance (1 in 255 a way) costs only a look at that slot's head.
 * Lookups read without a lock; a slot's writer holds its set's lock (try-lock: a writer that finds
 * it taken offers its row to nobody, the cache is only a cache).
 *
 * Publishing: a slot's version is odd while its writer changes it. The writer makes the version odd,
 * then writes the id and the row's bytes, then makes the version even again (a release store), then
 * sets the fingerprint: a reader checks the version before and after it reads the id and copies the
 * bytes, and takes the copy only when both are the same even number and the id is its own. So a
 * row's bytes are in place before anything can find them, and a slot overwritten while a lookup
 * copies it is a miss for that lookup, never a torn or foreign row. The fingerprints are only a
 * filter: what a reader takes is decided by the slot's id and version alone.
 *
 * Policies (policy): POLICY_TINYLFU admits a missed row only when its estimated frequency is above
 * that of the row it would evict, the victim being the set's row of the lowest frequency: one-off
 * rows then never flush hot ones. A held row's frequency is its slot's policy word: the estimate it
 * was admitted with, raised by each hit (saturating). A row not held is estimated from its misses:
 * a doorkeeper bit (the id missed in the current period) plus a count-min sketch of the ids that
 * missed more than once (4 rows of saturating counters, 1-2 a slot, raised by conservative update:
 * only the counters at the minimum). So a hit touches nothing but its set and its row. Counts fade:
 * every AGE_EVERY accesses four counters and one slot's word are halved and one word of the
 * doorkeeper cleared, in turn, so the whole sketch, the held rows' counts and the doorkeeper age
 * once in AGE_EVERY x width accesses. POLICY_LRU evicts the set's least recently used slot and
 * admits every row; POLICY_CLOCK gives each slot a second chance. docs/TRAFFIC.md compares the policies on a serving trace, and
 * scripts/profile_cold.py --parts policies measures this cache's.
 *
 * Speed: a hit is bound by the memory it reads, not by its instructions, so a hit reads few cache
 * lines (the set's fingerprints, the slot; a miss also reads the set's slot heads, the id's four
 * counters, which share one 64-byte block of the sketch, and its doorkeeper word), lookups
 * ask for them some ids ahead (ple_cache_prefetch), and no access takes a locked instruction of its
 * own (ticks, aging and counts are taken a window of ids at once), which would hold back the reads
 * after it.
 */
#include "rowcopy.h"
#include "sanitize.h"

#include <sched.h>

enum { POLICY_TINYLFU, POLICY_LRU, POLICY_CLOCK };
#define WAYS PLE_CACHE_WAYS
#define SKETCH_ROWS 4
#define SATURATE 15
#define HELD_MOST (SATURATE + 1) /* a held row's count: at most the estimate of one not held */
#define AGE_EVERY 10 /* accesses per counter halved: counts fade over 10-20 x the cache's slots */

struct ple_cache {
    int64_t sets;
    int64_t rb;    /* bytes per row */
    int32_t policy;
    int32_t publish_first; /* tests only: publish the tag before the bytes (a wrong cache) */
    uint64_t *fingerprints; /* [sets * WAYS / 8]: a byte a slot */
    int64_t stride;         /* bytes per slot: its head, then the row's rb bytes (a multiple of 8) */
    uint8_t *locks;         /* [sets] */
    uint8_t *data;          /* [sets * WAYS * stride] */
    uint8_t *sketch;       /* [SKETCH_ROWS * (sketch_mask + 1)] */
    int64_t sketch_mask;
    uint64_t *door;  /* [door_words]: 64 bits per word */
    int64_t door_words; /* a power of two */
    uint64_t *clock; /* [2]: accesses (LRU's time and the sketch's aging cursor), CLOCK's hand */
    int64_t *counts; /* the table's counters (rowcopy.h's enum) */
};

/* A slot's head; the row's bytes follow it. */
struct slot_head {
    int64_t id;       /* the id whose row the slot holds, or -1 */
    uint32_t version; /* odd while the slot is written */
    uint32_t meta;    /* its count (TINYLFU), last use (LRU), second chance (CLOCK) */
};

int64_t ple_cache_struct_size(void) { return (int64_t)sizeof(struct ple_cache); }
int64_t ple_cache_ways(void) { return WAYS; }
int64_t ple_cache_slot_head(void) { return (int64_t)sizeof(struct slot_head); }

/* Slot k (of set k / WAYS): its head, its row's bytes, its fingerprint. */
static inline struct slot_head *head_of(const ple_cache_t *c, int64_t k) {
    return (struct slot_head *)(c->data + k * c->stride);
}
static inline uint8_t *row_of(const ple_cache_t *c, int64_t k) { return c->data + k * c->stride + sizeof(struct slot_head); }
static inline uint8_t *fingerprint_at(const ple_cache_t *c, int64_t k) { return (uint8_t *)c->fingerprints + k; }
static inline int64_t *tag_of(const ple_cache_t *c, int64_t k) { return &head_of(c, k)->id; }
static inline uint32_t *version_of(const ple_cache_t *c, int64_t k) { return &head_of(c, k)->version; }
static inline uint32_t *meta_of(const ple_cache_t *c, int64_t k) { return &head_of(c, k)->meta; }

/* An id's fingerprint, from its hash's low byte (the set comes from its high bits); never 0. */
static inline uint32_t fingerprint(uint64_t h) { return (h & 255) ? (uint32_t)(h & 255) : 1; }

/* The ways of `set` that hold fingerprint f: a bit per way. A set's fingerprints are its WAYS
 * bytes (way w's is byte w), read as little-endian words of eight: in each word, the bytes equal to
 * f become zero bytes, found exactly (no carry crosses a byte), and their top bits are gathered into
 * eight bits by a multiply. Writers store single bytes and readers load words: a word read while a
 * byte is written can only filter wrongly, which the slot's id and version check catches. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a set's fingerprints are read as little-endian words");
_Static_assert(WAYS % 8 == 0 && WAYS <= 32, "a set's fingerprints are whole words, its ways a 32-bit mask");
static inline uint32_t ways_of(const ple_cache_t *c, int64_t set, uint32_t f) {
    const uint64_t low7 = 0x7f7f7f7f7f7f7f7fULL;
    uint32_t found = 0;
    for (int q = 0; q < WAYS / 8; q++) {
        uint64_t x = __atomic_load_n(&c->fingerprints[set * (WAYS / 8) + q], __ATOMIC_RELAXED) ^ (0x0101010101010101ULL * f);
        uint64_t zero = ~(((x & low7) + low7) | x | low7); /* 0x80 in each byte that held f */
        found |= (uint32_t)(((zero >> 7) * 0x0102040810204080ULL) >> 56) << (8 * q);
    }
    return found;
}

/* The set of an id's hash: its place in [0, sets) by a multiply (any number of sets). */
static inline int64_t set_of(const ple_cache_t *c, uint64_t h) {
    return (int64_t)(((unsigned __int128)h * (uint64_t)c->sets) >> 64);
}

static inline uint32_t load32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline int64_t load_tag(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

/* The doorkeeper's word of the id of hash h, and its two bits there (one cache line an access). */
static inline uint64_t *door_word(const ple_cache_t *c, uint64_t h, uint64_t *mask) {
    uint64_t g = mix(h ^ 0x5851f42d4c957f2dULL);
    *mask = 1ULL << (g >> 58) | 1ULL << ((g >> 52) & 63);
    return &c->door[g & (uint64_t)(c->door_words - 1)];
}

/* The doorkeeper: whether an id was seen this period (its bits set now, and returned as they
 * were). The bits are set without a locked instruction: two lookups that set bits of one word at
 * once may lose one's, which costs that id one more sighting, never a wrong row. */
static int door_seen(ple_cache_t *c, uint64_t h, int set) {
    uint64_t mask, *word = door_word(c, h, &mask), v = __atomic_load_n(word, __ATOMIC_RELAXED);
    if ((v & mask) == mask) return 1;
    if (set) __atomic_store_n(word, v | mask, __ATOMIC_RELAXED);
    return 0;
}

/* The sketch's block of the id of hash h: 64 bytes (one cache line), SKETCH_ROWS rows of 16
 * counters; the id's counter of row r is *g's 4 bits r of that row's 16. */
static inline uint8_t *sketch_block(const ple_cache_t *c, uint64_t h, uint64_t *g) {
    uint64_t x = mix(h + 0x9e3779b97f4a7c15ULL);
    *g = x >> 32;
    return c->sketch + ((x & (uint64_t)((c->sketch_mask + 1) / 16 - 1)) << 6);
}

static inline uint8_t *counter(const uint8_t *block, uint64_t g, int r) {
    return (uint8_t *)block + 16 * r + ((g >> (4 * r)) & 15);
}

static int sketch_min(const uint8_t *block, uint64_t g) {
    int best = SATURATE;
    for (int r = 0; r < SKETCH_ROWS; r++) {
        int v = __atomic_load_n(counter(block, g, r), __ATOMIC_RELAXED);
        if (v < best) best = v;
    }
    return best;
}

/* One step of TINYLFU's aging (the step of number `at`): SKETCH_ROWS counters, one held row's
 * count and one doorkeeper word, in turn over the whole sketch, the slots and the doorkeeper. */
static void age_step(ple_cache_t *c, uint64_t at) {
    uint64_t width = (uint64_t)c->sketch_mask + 1, slot = at & (width - 1);
    uint8_t *old = c->sketch + ((at * SKETCH_ROWS) & (SKETCH_ROWS * width - 1));
    for (int r = 0; r < SKETCH_ROWS; r++)
        __atomic_store_n(old + r, (uint8_t)(__atomic_load_n(old + r, __ATOMIC_RELAXED) >> 1), __ATOMIC_RELAXED);
    if (slot < (uint64_t)(c->sets * WAYS)) { /* width >= slots: the slots age as often as the sketch */
        uint32_t *m = meta_of(c, (int64_t)slot);
        __atomic_store_n(m, __atomic_load_n(m, __ATOMIC_RELAXED) >> 1, __ATOMIC_RELAXED);
    }
    /* door_words = width: the doorkeeper swept as often as the sketch */
    __atomic_store_n(&c->door[at & (uint64_t)(c->door_words - 1)], 0, __ATOMIC_RELAXED);
}

/* Accesses' ticks: an access's place among all of the cache's accesses (LRU's time, TINYLFU's
 * aging). A lookup takes the ticks of n accesses at once, the first returned: one locked
 * instruction a window of ids instead of one an access (each is a full fence on x86, which would
 * keep the accesses' memory reads from overlapping). The aging steps those n accesses are due are
 * taken here too: sequential memory, so they cost far less than a line an access. */
uint64_t ple_cache_ticks(ple_cache_t *c, int64_t n) {
    uint64_t first = __atomic_fetch_add(&c->clock[0], (uint64_t)n, __ATOMIC_RELAXED);
    if (c->policy == POLICY_TINYLFU)
        for (uint64_t at = (first + AGE_EVERY - 1) / AGE_EVERY; at * AGE_EVERY < first + (uint64_t)n; at++)
            age_step(c, at);
    return first;
}

/* Hits and misses counted into the table's counters, a window's at once. */
void ple_cache_count(ple_cache_t *c, int64_t hits, int64_t misses) {
    count(c->counts, C_CACHE_HITS, hits);
    count(c->counts, C_CACHE_MISSES, misses);
}

/* One miss of the id of hash h, counted for its admission; returns its estimate, this miss
 * included: the sketch's count plus its doorkeeper bit. */
static int sketch_add(ple_cache_t *c, uint64_t h) {
    int seen = door_seen(c, h, 1); /* a first sighting only sets the doorkeeper */
    uint64_t g;
    uint8_t *block = sketch_block(c, h, &g);
    int low = sketch_min(block, g);
    if (seen && low < SATURATE) {
        for (int r = 0; r < SKETCH_ROWS; r++) { /* conservative update: only the counters at the minimum */
            uint8_t *at = counter(block, g, r);
            if (__atomic_load_n(at, __ATOMIC_RELAXED) == low) __atomic_store_n(at, (uint8_t)(low + 1), __ATOMIC_RELAXED);
        }
        low++;
    }
    return low + 1;
}

/* Ask for the memory a get of the id of hash h (ple_cache_hash) will look at first (its set's
 * fingerprints) without waiting for it: a lookup calls this for ids ahead of the one it serves, so
 * that the get finds them in the CPU's caches. */
void ple_cache_prefetch(const ple_cache_t *c, uint64_t h) {
    __builtin_prefetch(&c->fingerprints[set_of(c, h) * (WAYS / 8)], 0, 3);
}

/* Ask for the slots whose fingerprint is that of the id of hash h, without waiting for them, and
 * return their ways (a bit a way) for its get: called once the set's fingerprints are at hand
 * (ple_cache_prefetch some ids before). A hint only: the get checks each slot it names. */
uint32_t ple_cache_prefetch_row(const ple_cache_t *c, uint64_t h) {
    int64_t set = set_of(c, h);
    uint32_t ways = ways_of(c, set, fingerprint(h));
    for (uint32_t left = ways; left; left &= left - 1)
        prefetch_bytes((const uint8_t *)head_of(c, set * WAYS + __builtin_ctz(left)),
                       (int64_t)sizeof(struct slot_head) + c->rb);
    return ways;
}

/* The row of `id` (of hash h: ple_cache_hash) copied to dst (1), or 0 when the cache does not
 * hold it: looked for in the slots of `ways` (ple_cache_prefetch_row's; a slot written since is
 * checked like any other, and a row put since in another slot is a miss); `tick`: the access's
 * (ple_cache_ticks). The caller counts the hit or miss (ple_cache_count), and offers the row of a
 * miss once read (ple_cache_put). */
int ple_cache_get(ple_cache_t *c, int64_t id, uint64_t h, uint32_t ways, uint8_t *dst, uint64_t tick) {
    int64_t set = set_of(c, h);
    for (; ways; ways &= ways - 1) {
        int64_t k = set * WAYS + __builtin_ctz(ways);
        uint32_t before = load32(version_of(c, k));
        if (before & 1) break;
        if (load_tag(tag_of(c, k)) != id) continue;
        PLE_RACY_READS_BEGIN(); /* a sequence lock's copy: used only when the version held (sanitize.h) */
        memcpy(dst, row_of(c, k), (size_t)c->rb);
        PLE_RACY_READS_END();
        atomic_thread_fence(memory_order_acquire);
        if (__atomic_load_n(version_of(c, k), __ATOMIC_RELAXED) != before) break;
        uint32_t *m = meta_of(c, k);
        if (c->policy == POLICY_TINYLFU) {
            uint32_t v = __atomic_load_n(m, __ATOMIC_RELAXED);
            if (v < HELD_MOST) __atomic_store_n(m, v + 1, __ATOMIC_RELAXED);
        } else if (c->policy == POLICY_LRU) {
            __atomic_store_n(m, (uint32_t)tick, __ATOMIC_RELAXED);
        } else {
            __atomic_store_n(m, 1, __ATOMIC_RELAXED);
        }
        return 1;
    }
    return 0;
}

/* The slot of set [first, first + ways) the new row would take, or -1 to keep the set as it is. */
static int64_t choose(ple_cache_t *c, int64_t first, int estimate) {
    int64_t victim = -1;
    for (int32_t w = 0; w < WAYS; w++)
        if (*fingerprint_at(c, first + w) == 0) return first + w;
    if (c->policy == POLICY_CLOCK) {
        for (int32_t turn = 0; turn < 2 * WAYS; turn++) {
            int64_t k = first + (int64_t)(__atomic_fetch_add(&c->clock[1], 1, __ATOMIC_RELAXED) % (uint64_t)WAYS);
            if (__atomic_exchange_n(meta_of(c, k), 0, __ATOMIC_RELAXED) == 0) return k;
        }
        return first;
    }
    if (c->policy == POLICY_LRU) {
        for (int32_t w = 0; w < WAYS; w++) /* the least recently used */
            if (victim < 0 || __atomic_load_n(meta_of(c, first + w), __ATOMIC_RELAXED) <
                                  __atomic_load_n(meta_of(c, victim), __ATOMIC_RELAXED))
                victim = first + w;
        return victim;
    }
    uint32_t low = 0; /* TINYLFU: the slot whose row is wanted least; kept unless beaten */
    for (int32_t w = 0; w < WAYS; w++) {
        uint32_t f = __atomic_load_n(meta_of(c, first + w), __ATOMIC_RELAXED);
        if (victim < 0 || f < low) victim = first + w, low = f;
    }
    return (uint32_t)estimate > low ? victim : -1;
}

/* Offer the row of `id`, which the cache did not hold, just read (row: its bytes); the policy
 * decides whether it is kept. */
void ple_cache_put(ple_cache_t *c, int64_t id, const uint8_t *row) {
    uint64_t h = ple_cache_hash(id);
    int64_t set = set_of(c, h), first = set * WAYS;
    int estimate = c->policy == POLICY_TINYLFU ? sketch_add(c, h) : 0;
    if (__atomic_test_and_set(&c->locks[set], __ATOMIC_ACQUIRE)) return;
    for (uint32_t ways = ways_of(c, set, fingerprint(h)); ways; ways &= ways - 1)
        if (*tag_of(c, first + __builtin_ctz(ways)) == id) {
            __atomic_clear(&c->locks[set], __ATOMIC_RELEASE);
            return;
        }
    int64_t k = choose(c, first, estimate);
    if (k >= 0) {
        int64_t evicted = *tag_of(c, k);
        uint32_t v = *version_of(c, k);
        __atomic_store_n(version_of(c, k), v + 1, __ATOMIC_RELAXED); /* odd: being written */
        atomic_thread_fence(memory_order_release);
        if (c->publish_first) {
            __atomic_store_n(tag_of(c, k), id, __ATOMIC_RELAXED);
            __atomic_store_n(version_of(c, k), v + 2, __ATOMIC_RELEASE);
            __atomic_store_n(fingerprint_at(c, k), (uint8_t)fingerprint(h), __ATOMIC_RELAXED);
            for (int spin = 0; spin < 200; spin++) sched_yield(); /* a reader may find it meanwhile */
            memcpy(row_of(c, k), row, (size_t)c->rb);
        } else {
            __atomic_store_n(tag_of(c, k), id, __ATOMIC_RELAXED);
            memcpy(row_of(c, k), row, (size_t)c->rb);
            __atomic_store_n(version_of(c, k), v + 2, __ATOMIC_RELEASE); /* even: published */
        }
        __atomic_store_n(fingerprint_at(c, k), (uint8_t)fingerprint(h), __ATOMIC_RELAXED);
        uint32_t fresh = c->policy == POLICY_LRU       ? (uint32_t)__atomic_fetch_add(&c->clock[0], 1, __ATOMIC_RELAXED)
                         : c->policy == POLICY_TINYLFU ? (uint32_t)estimate
                                                       : 1;
        __atomic_store_n(meta_of(c, k), fresh, __ATOMIC_RELAXED);
        count(c->counts, C_CACHE_INSERTS, 1);
        count(c->counts, C_CACHE_EVICTIONS, evicted != -1);
    }
    __atomic_clear(&c->locks[set], __ATOMIC_RELEASE);
}
