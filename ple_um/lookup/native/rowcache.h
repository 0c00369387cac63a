/* The row cache's memory as rowcache.c lays it out (rowcache.c says what each part is for): the
 * struct behind rowcopy.h's ple_cache_t, a set's head, and the reads that find an id's slot. Private
 * to rowcache.c. */
#ifndef PLE_ROWCACHE_H
#define PLE_ROWCACHE_H

#include "rowcopy.h"

#define WAYS PLE_CACHE_WAYS
#define TAG_MOST 0xffffffffULL

struct ple_cache {
    int64_t sets;
    int64_t rb; /* bytes per row: slot k's row lies at data + k * rb */
    int32_t policy;
    int32_t follower; /* 1: the tags, heads, sketch and doorkeeper are the cache's it follows */
    uint32_t *tags;  /* [sets * WAYS]: id + 1, or 0 */
    uint8_t *heads;  /* [sets]: struct set_head */
    uint8_t *data;   /* [sets * WAYS * rb] */
    uint8_t *sketch; /* [sketch_blocks * 64] */
    int64_t sketch_blocks;
    uint64_t *door;  /* [door_words]: 64 bits per word */
    int64_t door_words;
    uint64_t *clock; /* [2]: accesses (the aging cursor), unused */
    int64_t *counts; /* the table's counters (rowcopy.h's enum) */
};

/* A set's head. */
struct set_head {
    uint32_t version; /* odd while a slot of the set (of the cache or its follower) is written */
    uint16_t hand;    /* CLOCK's next way */
    uint16_t follows; /* a bit a way: the follower's slot holds the part of the row the tag names */
    uint64_t policy;  /* 4 bits a way: its count (TINYLFU), rank (LRU), second chance (CLOCK) */
};

_Static_assert(WAYS == 16, "a set's tags are one 64-byte line and its policy word 16 fields of 4 bits");

static inline struct set_head *head_of(const ple_cache_t *c, int64_t set) {
    return (struct set_head *)(c->heads + set * (int64_t)sizeof(struct set_head));
}
static inline uint8_t *row_of(const ple_cache_t *c, int64_t k) { return c->data + k * c->rb; }

/* The tag of an id: id + 1, or 0 for an id no tag holds (the cache never holds its row). */
static inline uint32_t tag_for(int64_t id) { return id >= 0 && (uint64_t)id < TAG_MOST - 1 ? (uint32_t)(id + 1) : 0; }

/* The ways of `set` whose tag is `tag`: a bit per way. The line is copied first so that the
 * compare runs on registers (the compiler makes it a few vector compares); a tag written meanwhile
 * can only make the answer wrong, which the set's version check catches. */
static inline uint32_t ways_of(const ple_cache_t *c, int64_t set, uint32_t tag) {
    uint32_t line[WAYS], found = 0;
    memcpy(line, c->tags + set * WAYS, sizeof line);
    for (int w = 0; w < WAYS; w++) found |= (uint32_t)(line[w] == tag) << w;
    return found;
}

/* The set of an id's hash: its place in [0, sets) by a multiply (any number of sets). */
static inline int64_t set_of(const ple_cache_t *c, uint64_t h) {
    return (int64_t)(((unsigned __int128)h * (uint64_t)c->sets) >> 64);
}

#endif
