"""RowCache: hot rows of a table kept at row granularity, in host memory the table owns.

The page cache keeps a row as the 4 KiB page it lies in; with hashed n-gram ids the other rows of
that page are rarely hot, so a page cache of C bytes holds about C / 4 KiB hot rows. A row cache of
the same bytes holds about C / (row bytes + ``SLOT_OVERHEAD``) of them. The C row copy looks every
owned row up here first and offers the rows it had to read (``native/rowcache.c``: set-associative,
lock-free reads, a row's bytes in place before anything can find it; the policy decides what is
kept).

The memory is anonymous (``mmap``, transparent huge pages where the kernel gives them), faulted in
when the cache is made (so that no lookup pays for a first touch), owned by this object and
released by ``close()`` once no lookup can read it any more (the host gather's release waits for
its row copies). It is not pinned: only the CPU reads it.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from ple_um.lookup import rowcopy
from ple_um.mapping import _libc

POLICIES = {"tinylfu": 0, "lru": 1, "clock": 2}
WAYS = rowcopy.CACHE_WAYS  # slots per set: an id is looked for in one set only
# A slot's share of the admission sketch (4 rows of 1-2 one-byte counters a slot) and of the
# doorkeeper (8-16 bytes a slot: about 6 bits for each access of the period it remembers, 10 x the
# sketch's width), at most.
SHARED_PER_SLOT = 8 + 16
# Bytes a slot takes beside its row's, at most: its fingerprint (one byte of its set's words); its
# head (id, version, policy word) and the padding to a multiple of 8; SHARED_PER_SLOT.
SLOT_OVERHEAD = 1 + rowcopy.CACHE_SLOT_HEAD + 7 + SHARED_PER_SLOT
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23


def _populate(base: int, memory: mmap.mmap, nbytes: int) -> None:
    """Fault every page of the cache in now (MADV_POPULATE_WRITE, Linux 5.14+; else a write to each
    page): a page first touched by a lookup costs that lookup its zeroing (a 2 MiB page: a tenth of
    a millisecond or more), and a lookup's rows fall on pages all over the cache."""
    if _libc.madvise(base, nbytes, MADV_POPULATE_WRITE) == 0:
        return
    view = np.frombuffer(memory, dtype=np.uint8)
    view[:: mmap.PAGESIZE] = 0


def stride(row_bytes: int) -> int:
    """The bytes of one slot in the cache's data: its head, then the row, to a multiple of 8 (the
    next slot's id stays aligned)."""
    return -(-(rowcopy.CACHE_SLOT_HEAD + row_bytes) // 8) * 8


def slots_for(capacity: int, row_bytes: int) -> int:
    """The slots a cache of ``capacity`` bytes has: sets of WAYS slots (0 when not even one set
    fits; the sketch and doorkeeper are a power of two wide, so a cache may take a little less)."""
    slot = 1 + stride(row_bytes) + SHARED_PER_SLOT  # its fingerprint, the slot, its share
    return WAYS * max(0, capacity // (WAYS * slot))


class RowCache:
    """A row cache of ``slots`` slots (a multiple of WAYS) for rows of ``row_bytes``; hits, misses,
    insertions and evictions are added to ``counts`` (the host gather's ``rowcopy.Counts``)."""

    def __init__(
        self, slots: int, row_bytes: int, counts: rowcopy.Counts, *, policy: str = "tinylfu"
    ) -> None:
        sets = slots // WAYS
        if slots <= 0 or slots % WAYS:
            raise ValueError(f"a row cache has sets of {WAYS} slots, not {slots} slots")
        if policy not in POLICIES:
            raise ValueError(f"row cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.slots, self.row_bytes, self.policy = slots, row_bytes, policy
        sketch_width = 1 << max(4, (slots - 1).bit_length())  # 1-2 counters a slot a row (rowcache.c)
        door_words = sketch_width  # 64 doorkeeper bits a counter (rowcache.c)
        self.stride = stride(row_bytes)
        layout = [
            ("fingerprints", sets * WAYS),
            ("locks", sets),
            ("sketch", 4 * sketch_width),
            ("door", 8 * door_words),
            ("clock", 16),
            ("data", slots * self.stride),
        ]
        self.nbytes = sum(-(-n // 64) * 64 for _, n in layout)
        self._memory = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        _libc.madvise(base, self.nbytes, MADV_HUGEPAGE)  # a hint: fewer TLB misses where it is taken
        _populate(base, self._memory, self.nbytes)
        at, self._base = {}, base
        offset = 0
        for name, n in layout:
            at[name] = base + offset
            offset += -(-n // 64) * 64
        words = self.stride // 8
        data = np.ctypeslib.as_array((ctypes.c_int64 * (slots * words)).from_address(at["data"]))
        data.reshape(slots, words)[:, 0] = -1  # every slot's id: no row (and its fingerprint 0)
        self.struct = rowcopy.CacheStruct(
            sets,
            row_bytes,
            POLICIES[policy],
            0,
            at["fingerprints"],
            self.stride,
            at["locks"],
            at["data"],
            at["sketch"],
            sketch_width - 1,
            at["door"],
            door_words,
            at["clock"],
            counts.address,
        )
        self.address = ctypes.addressof(self.struct)
        self._counts = counts

    def resident_bytes(self) -> int:
        """Bytes of the cache's memory that are in RAM now (mincore: pages it has written)."""
        pages = -(-self.nbytes // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        if self._memory is None or _libc.mincore(self._base, self.nbytes, vec.ctypes.data) != 0:
            return 0
        return int((vec & 1).sum()) * mmap.PAGESIZE

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
