"""The storage's ceiling for rows that are not in memory: random reads from the table's own files,
one at a time and with many in flight, of a page (4 KiB) and of a sector (512 B).

Reads bypass the page cache (O_DIRECT) where the filesystem allows it; where it does not (tmpfs,
some network filesystems) they go through the page cache, the files' pages dropped first and
readahead off, and the figure says so. Each depth runs that many threads issuing ``preadv`` (which
releases the GIL) on their share of one list of random aligned offsets.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np

from ple_um.residency import evict_pages

DEPTHS = (1, 16, 64)
READ_SIZES = (4096, 512)
# Reads per depth: enough for a stable rate at depth 64 on NVMe (a few tenths of a second), few
# enough at depth 1 on a slow disk.
READS = {1: 2000, 16: 8000, 64: 16000}


def _open(path: str, direct: bool) -> int:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    if not direct:  # readahead off (advice on this open file): only the bytes read come in
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _direct_works(path: str, size: int) -> str | None:
    """None where an O_DIRECT read of ``size`` bytes at offset 0 works on ``path``, else why not."""
    try:
        fd = _open(path, True)
    except OSError as exc:
        return f"O_DIRECT refused: {exc.strerror}"
    buf = mmap.mmap(-1, mmap.PAGESIZE)  # page-aligned: O_DIRECT needs aligned memory
    try:
        os.preadv(fd, [memoryview(buf)[:size]], 0)
    except OSError as exc:
        return f"O_DIRECT read of {size} B refused: {exc.strerror}"
    finally:
        buf.close()
        os.close(fd)
    return None


def _offsets(files: list[str], size: int, count: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """``count`` (file index, offset) pairs, files weighted by their size, offsets ``size``-aligned."""
    blocks = np.array([max(1, os.path.getsize(f) // size - 1) for f in files], dtype=np.int64)
    which = rng.choice(len(files), size=count, p=blocks / blocks.sum())
    at = (rng.random(count) * blocks[which]).astype(np.int64) * size
    return list(zip(which.tolist(), at.tolist(), strict=True))


def _reads(files: list[str], size: int, depth: int, count: int, direct: bool) -> dict:
    jobs = _offsets(files, size, count, np.random.default_rng(depth))  # each depth its own offsets
    if not direct:
        evict_pages(files, write_back=False)  # files this bench only reads
    fds = [_open(f, direct) for f in files]
    errors: list[OSError] = []

    def work(mine: list[tuple[int, int]]) -> None:
        buf = mmap.mmap(-1, mmap.PAGESIZE)
        view = memoryview(buf)[:size]
        try:
            for k, offset in mine:
                os.preadv(fds[k], [view], offset)
        except OSError as exc:
            errors.append(exc)
        finally:
            view.release()
            buf.close()

    threads = [threading.Thread(target=work, args=(jobs[i::depth],)) for i in range(depth)]
    try:
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)
    if errors:
        raise errors[0]
    return {
        "reads": count,
        "reads_per_s": count / seconds,
        "us_per_read": seconds / count * depth * 1e6,  # each thread's reads one after another
    }


def ceiling(
    files: list[str],
    depths=DEPTHS,
    sizes=READ_SIZES,
    reads: dict | None = None,
    direct: bool = True,
) -> dict:
    """Random-read rates of the storage under ``files``: per read size and depth, reads per second
    and the latency of one read, with how they were read (O_DIRECT where the filesystem takes it
    and ``direct``, else buffered and why)."""
    reads = reads or READS
    out: dict = {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files), "sizes": {}}
    for size in sizes:
        why = _direct_works(files[0], size) if direct else "O_DIRECT not asked for"
        entry: dict = {"direct": why is None, "how": "O_DIRECT" if why is None else f"buffered ({why})"}
        for depth in depths:
            count = reads.get(depth, max(READS.values()))
            entry[str(depth)] = _reads(files, size, depth, count, why is None)
        out["sizes"][str(size)] = entry
    return out


def ceiling_us(storage: dict, rows: int, depth: int = 64, size: int = 4096) -> float | None:
    """What ``rows`` cold rows cost at the storage's best: one ``size`` read each at ``depth`` in
    flight (rows / reads-per-second), in microseconds; None where that was not measured."""
    try:
        rate = storage["sizes"][str(size)][str(depth)]["reads_per_s"]
    except KeyError:
        return None
    return rows / rate * 1e6
