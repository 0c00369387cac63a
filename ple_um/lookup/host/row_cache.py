"""RowCache: hot rows of a table kept at row granularity, in host memory the table owns.

The page cache keeps a row as the 4 KiB page it lies in; with hashed n-gram ids the other rows of
that page are rarely hot, so a page cache of C bytes holds about C / 4 KiB hot rows. A row cache of
the same bytes holds about C / (row bytes + ``SLOT_OVERHEAD``) of them (8 bytes beside a row:
``native/rowcopy.h``). The C row copy looks every owned row up here first and offers the rows it
had to read (``native/rowcache.c``: set-associative, lock-free reads, a row's bytes in place before
anything can find it; the policy decides what is kept).

The memory is anonymous (``mmap``, transparent huge pages where the kernel gives them), faulted in
when the cache is made (so that no lookup pays for a first touch), owned by this object and
released by ``close()`` once no lookup can read it any more (the host gather's release waits for
its row copies). It is not pinned: only the CPU reads it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap

import numpy as np

from ple_um import residency
from ple_um.lookup import rowcopy
from ple_um.mapping import _libc

POLICIES = {"tinylfu": 0, "lru": 1, "clock": 2}
WAYS = rowcopy.CACHE_WAYS  # slots per set: an id is looked for in one set only
# The admission sketch's 4-bit counters and the doorkeeper's bits, a slot's share of each (TinyLFU:
# rowcache.c).
SKETCH_COUNTERS_PER_SLOT = 2
DOOR_BITS_PER_SLOT = 16
# Bytes a slot takes beside its row's: its tag (4), its share of its set's head, of the sketch and
# of the doorkeeper (each array is also rounded up to 64 bytes: nbytes_for is the exact figure).
# A follower's slot (a table's block scales) is its bytes alone: the rest is its rows' cache's.
SLOT_OVERHEAD = 4 + rowcopy.CACHE_SET_HEAD // WAYS + SKETCH_COUNTERS_PER_SLOT // 2 + DOOR_BITS_PER_SLOT // 8
LRU_FRESH = 0xFEDCBA9876543210  # a set's LRU word before any use: way w of rank w (rowcache.c)
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23


def _populate(base: int, memory: mmap.mmap, nbytes: int) -> None:
    """Fault every page of the cache in now (MADV_POPULATE_WRITE, Linux 5.14+; where the kernel lacks
    it, EINVAL, a write to each page): a page first touched by a lookup costs that lookup its zeroing
    (a 2 MiB page: a tenth of a millisecond or more), and a lookup's rows fall on pages all over the
    cache. Where the kernel has it but could not fault the pages in (ENOMEM, EFAULT: memory ran
    out), MemoryError: writing each page would only bring the OOM killer instead."""
    if _libc.madvise(base, nbytes, MADV_POPULATE_WRITE) == 0:
        return
    if ctypes.get_errno() != errno.EINVAL:
        raise MemoryError(
            f"the row cache's {nbytes} bytes could not be faulted in (madvise MADV_POPULATE_WRITE: "
            f"{residency.errno_text()}): too little memory left; a smaller PLE_UM_ROW_CACHE (0: none) "
            "leaves more"
        )
    view = np.frombuffer(memory, dtype=np.uint8)
    view[:: mmap.PAGESIZE] = 0


def _layout(slots: int, row_bytes: int, follower: bool) -> tuple[dict[str, int], int]:
    """Where the arrays of a cache of ``slots`` slots lie in its memory (rowcache.c's struct
    ple_cache; a follower's are its rows alone), each rounded up to 64 bytes, and the bytes of
    them all."""
    sizes = [("data", slots * row_bytes)]
    if not follower:
        sizes = [
            ("tags", 4 * slots),
            ("heads", rowcopy.CACHE_SET_HEAD * (slots // WAYS)),
            ("clock", 16),
            *sizes,
            ("sketch", 64 * _sketch_blocks(slots)),
            ("door", 8 * _door_words(slots)),
        ]
    offsets, end = {}, 0
    for name, n in sizes:
        offsets[name], end = end, end + -(-n // 64) * 64
    return offsets, end


def _sketch_blocks(slots: int) -> int:
    return -(-slots * SKETCH_COUNTERS_PER_SLOT // 128)  # 64-byte blocks of 128 counters


def _door_words(slots: int) -> int:
    return -(-slots * DOOR_BITS_PER_SLOT // 64)


def nbytes_for(slots: int, row_bytes: int, *, follower: bool = False) -> int:
    """The bytes a cache of ``slots`` slots for rows of ``row_bytes`` allocates (each array rounded
    up to 64 bytes): what ``RowCache.nbytes`` is."""
    return _layout(slots, row_bytes, follower)[1]


def slots_for(capacity: int, row_bytes: int, *, block_scales: int = 0) -> int:
    """The slots a cache of ``capacity`` bytes has: sets of WAYS slots (0 when not even one set
    fits). With ``block_scales`` (a block-scaled table's scale bytes a row), the slots of each of
    two caches of as many slots that fit together: the rows' and a follower for the block scales."""

    def size(slots: int) -> int:
        scales = nbytes_for(slots, block_scales, follower=True) if block_scales else 0
        return nbytes_for(slots, row_bytes) + scales

    per_row = row_bytes + SLOT_OVERHEAD + block_scales
    slots = WAYS * max(0, capacity // (WAYS * per_row))
    while slots and size(slots) > capacity:  # the arrays' rounding
        slots -= WAYS
    return slots


class RowCache:
    """A row cache of ``slots`` slots (a multiple of WAYS) for rows of ``row_bytes``; hits, misses,
    insertions and evictions are added to ``counts`` (the host gather's ``rowcopy.Counts``). With
    ``follows`` (a block-scaled table's rows' cache, of as many slots, asked for the same ids just
    before this one), this cache holds another part of the rows that cache holds (its block scales):
    the tags, set heads and policy are that cache's, which must outlive this one; only hits and
    misses are counted here."""

    def __init__(
        self,
        slots: int,
        row_bytes: int,
        counts: rowcopy.Counts,
        *,
        policy: str = "tinylfu",
        follows: RowCache | None = None,
    ) -> None:
        sets = slots // WAYS
        if slots <= 0 or slots % WAYS:
            raise ValueError(f"a row cache has sets of {WAYS} slots, not {slots} slots")
        if policy not in POLICIES:
            raise ValueError(f"row cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if follows is not None and (follows.slots, follows.policy) != (slots, policy):
            raise ValueError("a row cache follows a cache of as many slots and the same policy")
        self.slots, self.row_bytes, self.policy = slots, row_bytes, policy
        offsets, self.nbytes = _layout(slots, row_bytes, follows is not None)
        self._memory = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        _libc.madvise(base, self.nbytes, MADV_HUGEPAGE)  # a hint: fewer TLB misses where it is taken
        try:
            _populate(base, self._memory, self.nbytes)
        except BaseException:
            self._memory.close()  # its pages back at once, not when the traceback is let go
            raise
        at, self._base = {name: base + offset for name, offset in offsets.items()}, base
        if policy == "lru" and follows is None:  # every other starting state is zero (empty tags...)
            heads = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * sets)).from_address(at["heads"]))
            heads.reshape(sets, 2)[:, 1] = LRU_FRESH
        if follows is not None:
            lead = follows.struct
            at.update(tags=lead.tags, heads=lead.heads, sketch=lead.sketch, door=lead.door, clock=lead.clock)
        self.struct = rowcopy.CacheStruct(
            sets,
            row_bytes,
            POLICIES[policy],
            follows is not None,
            at["tags"],
            at["heads"],
            at["data"],
            at["sketch"],
            _sketch_blocks(slots),
            at["door"],
            _door_words(slots),
            at["clock"],
            counts.address,
        )
        self.address = ctypes.addressof(self.struct)
        self._counts, self._follows = counts, follows

    def resident_bytes(self) -> int:
        """Bytes of the cache's memory that are in RAM now (mincore: pages it has written)."""
        if self._memory is None:
            return 0
        try:
            return residency.resident_bytes(self._base, self.nbytes, "a row cache")
        except OSError:  # closed meanwhile
            return 0

    def stats(self) -> dict:
        """hits, misses, evictions, rows (held now), bytes (the memory it owns), resident_bytes (of
        it in RAM now), slots."""
        c = self._counts.read()
        return {
            "hits": c["cache_hits"],
            "misses": c["cache_misses"],
            "evictions": c["cache_evictions"],
            "rows": self._counts.held_rows(),
            "bytes": self.nbytes,
            "resident_bytes": self.resident_bytes(),
            "slots": self.slots,
        }

    def close(self) -> None:
        """Release the memory (the caller has made sure no row copy reads it any more). Idempotent."""
        if self._memory is not None:
            self.struct = None
            self._memory.close()
            self._memory = None
