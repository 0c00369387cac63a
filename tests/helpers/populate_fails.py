"""The C library whose MADV_POPULATE_WRITE fails with a given errno, for the row cache's memory
(``ple_um.lookup.host.row_cache._libc``): a stand-in for libc, not for ple-um's code; a real
shortage of memory would take the machine's."""

from __future__ import annotations

import ctypes

from ple_um.lookup.host import row_cache
from ple_um.mapping import _libc


class PopulateFails:
    """The C library, but its MADV_POPULATE_WRITE fails with ``code``; every other call its own."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __getattr__(self, name):
        return getattr(_libc, name)

    def madvise(self, addr, length, advice) -> int:
        if advice == row_cache.MADV_POPULATE_WRITE:
            ctypes.set_errno(self.code)
            return -1
        return _libc.madvise(addr, length, advice)
