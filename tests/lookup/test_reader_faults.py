"""The reader of misses under faults (``native/reader.c``, ``native/uring.c``, ``host/file_reads.py``):
every result of every system call it makes is taken, nothing waits with nothing in flight.

The faults are injected at the kernel's door by an ``LD_PRELOAD`` shim compiled here (gcc, into a
temporary folder) that interposes ``syscall()`` (``io_uring_setup`` and ``io_uring_enter`` are
called through it), ``pread``/``pread64`` and ``mmap`` (to find a ring's completion queue, whose
results it can shorten or fail). Which call fails, with which errno, after how many calls and how
many times comes from environment variables, read when the scenario arms the shim (after the table
is open). A process with the shim preloaded (the lab, started once for the module) runs each
scenario in a forked child with a deadline: a hang is a failed test, not a hung suite. Each
scenario opens a fresh table in the ``cpu`` mode, drops its pages, and looks up fresh random ids
across the shard edges of an owned sub-range three times (the second time the same ids: the zero
rows of a failed read are never cached) into poisoned outputs, every row checked against the
reference reader; zero rows must be exactly the rows counted broken; a ring given up must say so
once in the log and in ``stats()``; the reader threads must be gone once the table is closed.

In the pytest process itself: a file truncated under a reader without a row cache (its last page
stays resident) gives counted zero rows, never a torn row; the reader threads are joined when the
last reader holding them closes, and nothing leaks over open and close cycles.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.reference import reference_rows
from helpers.rowcopy_jobs import boundary_ids, in_forked_child, make_job, reader_threads

from ple_um.lookup import rowcopy
from ple_um.lookup.host import file_reads
from ple_um.lookup.host.file_reads import FileReader
from ple_um.mapping import MappedShards
from ple_um.residency import evict_pages

SCENARIO_SECONDS = 30  # a scenario takes about a second; past this it hangs
LAB_START_SECONDS = 240  # importing torch on a loaded 2-core machine

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* A fault: errno to fail with (0: shorten instead), after how many calls, how many times (-1: all). */
typedef struct { int on, err; long after, times, calls, hits; } fault_t;
enum { F_SETUP, F_ENTER, F_PREAD, F_CQE, F_COUNT };
static const char *names[F_COUNT] = {"SHIM_SETUP", "SHIM_ENTER", "SHIM_PREAD", "SHIM_CQE"};
static fault_t faults[F_COUNT];
static int armed;
static long (*real_syscall)(long, ...);
static ssize_t (*real_pread)(int, void *, size_t, off_t);
static void *(*real_mmap)(void *, size_t, int, int, int, off_t);

/* Rings made since: their completion queues, found through their mapping. */
typedef struct { int fd; struct io_cqring_offsets off; unsigned char *base; unsigned seen; } ring_t;
static ring_t rings[64];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

/* The next definitions, found when first needed: another preloaded library (a sanitizer's runtime)
 * may call them before this one's constructors run. */
static void resolve(void) {
    if (!real_syscall) real_syscall = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    if (!real_pread) real_pread = (ssize_t (*)(int, void *, size_t, off_t))dlsym(RTLD_NEXT, "pread");
    if (!real_mmap) real_mmap = (void *(*)(void *, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap");
}

__attribute__((constructor)) static void init(void) {
    resolve();
    for (int k = 0; k < 64; k++) rings[k].fd = -1;
}

void shim_arm(void) {
    for (int k = 0; k < F_COUNT; k++) {
        fault_t f = {0, 0, 0, 0, 0, 0};
        const char *v = getenv(names[k]);
        if (v && sscanf(v, "%d:%ld:%ld", &f.err, &f.after, &f.times) == 3) f.on = 1;
        faults[k] = f;
    }
    __atomic_store_n(&armed, 1, __ATOMIC_SEQ_CST);
}

long shim_hits(int k) { return __atomic_load_n(&faults[k].hits, __ATOMIC_SEQ_CST); }

static int fire(int k) {
    fault_t *f = &faults[k];
    if (!__atomic_load_n(&armed, __ATOMIC_ACQUIRE) || !f->on) return 0;
    long c = __atomic_fetch_add(&f->calls, 1, __ATOMIC_SEQ_CST);
    if (c < f->after || (f->times >= 0 && c >= f->after + f->times)) return 0;
    __atomic_fetch_add(&f->hits, 1, __ATOMIC_SEQ_CST);
    return 1;
}

static ring_t *ring_of(int fd) {
    for (int k = 0; k < 64; k++)
        if (rings[k].fd == fd) return &rings[k];
    return NULL;
}

/* The completions posted since the last look, shortened or failed as SHIM_CQE says. */
static void mangle(int fd) {
    fault_t *f = &faults[F_CQE];
    if (!__atomic_load_n(&armed, __ATOMIC_ACQUIRE) || !f->on) return;
    pthread_mutex_lock(&mu);
    ring_t *r = ring_of(fd);
    if (r && r->base) {
        unsigned head = *(unsigned *)(r->base + r->off.head);
        unsigned tail = __atomic_load_n((unsigned *)(r->base + r->off.tail), __ATOMIC_ACQUIRE);
        unsigned mask = *(unsigned *)(r->base + r->off.ring_mask);
        struct io_uring_cqe *cqes = (struct io_uring_cqe *)(r->base + r->off.cqes);
        for (unsigned k = (int)(r->seen - head) > 0 ? r->seen : head; k != tail; k++) {
            struct io_uring_cqe *c = &cqes[k & mask];
            if ((f->err || c->res > 1) && fire(F_CQE)) c->res = f->err ? -f->err : c->res / 2;
        }
        r->seen = tail;
    }
    pthread_mutex_unlock(&mu);
}

long syscall(long n, ...) {
    va_list ap;
    resolve();
    long a[6];
    va_start(ap, n);
    for (int k = 0; k < 6; k++) a[k] = va_arg(ap, long);
    va_end(ap);
    if (n == __NR_io_uring_setup) {
        if (fire(F_SETUP)) { errno = faults[F_SETUP].err; return -1; }
        long fd = real_syscall(n, a[0], a[1], a[2], a[3], a[4], a[5]);
        if (fd >= 0) {
            pthread_mutex_lock(&mu);
            ring_t *r = ring_of((int)fd);
            if (!r) r = ring_of(-1);
            if (r) {
                r->fd = (int)fd, r->base = NULL, r->seen = 0;
                r->off = ((struct io_uring_params *)a[1])->cq_off;
            }
            pthread_mutex_unlock(&mu);
        }
        return fd;
    }
    if (n == __NR_io_uring_enter) {
        if (fire(F_ENTER)) { errno = faults[F_ENTER].err; return -1; }
        long rc = real_syscall(n, a[0], a[1], a[2], a[3], a[4], a[5]);
        int e = errno;
        mangle((int)a[0]);
        errno = e;
        return rc;
    }
    return real_syscall(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    resolve();
    void *p = real_mmap(addr, len, prot, flags, fd, off);
    if (p != MAP_FAILED && fd >= 0 && off == IORING_OFF_SQ_RING) {
        pthread_mutex_lock(&mu);
        ring_t *r = ring_of(fd);
        if (r && r->base == NULL) r->base = (unsigned char *)p;
        pthread_mutex_unlock(&mu);
    }
    return p;
}

static ssize_t shim_pread(int fd, void *buf, size_t count, off_t off) {
    resolve();
    if (fire(F_PREAD)) {
        if (faults[F_PREAD].err) { errno = faults[F_PREAD].err; return -1; }
        if (count > 1) count /= 2;
    }
    return real_pread(fd, buf, count, off);
}
ssize_t pread(int fd, void *buf, size_t count, off_t off) { return shim_pread(fd, buf, count, off); }
ssize_t pread64(int fd, void *buf, size_t count, off_t off) { return shim_pread(fd, buf, count, off); }
"""
FAULTS = ("setup", "enter", "pread", "cqe")  # the shim's F_* order
ROW_DIM, ROWS, SHARDS = 160, 12_000, 5
E = errno

# name: knobs, faults (what: "errno:after:times" in calls after the shim is armed, times -1 = all;
# errno 0 = shorten), the fallback expected (the call and errno stats() names; None: the ring stays).
# Depth 8 and about 1 400 misses a lookup: "mid" faults come with more misses left than the depth.
# The first lookup's zero rows are the preads failed with EIO (none elsewhere).
_URING, _CACHE, _NO_CACHE = (
    {"PLE_UM_FILE_READS": "uring"},
    {"PLE_UM_ROW_CACHE": "1MiB"},
    {"PLE_UM_ROW_CACHE": "0"},
)
SCENARIOS = {
    "enter-EINTR-first": ({**_URING, **_CACHE}, {"enter": f"{E.EINTR}:0:3"}, None),
    "enter-EINTR-mid": ({**_URING, **_NO_CACHE}, {"enter": f"{E.EINTR}:5:3"}, None),
    "enter-EAGAIN-passes": ({**_URING, **_CACHE}, {"enter": f"{E.EAGAIN}:0:4"}, None),
    "enter-EAGAIN-19-passes": ({**_URING, **_CACHE}, {"enter": f"{E.EAGAIN}:0:19"}, None),
    "enter-EAGAIN-20-stays": ({**_URING, **_CACHE}, {"enter": f"{E.EAGAIN}:0:20"}, "io_uring_enter: EAGAIN"),
    "enter-EAGAIN-first-stays": (
        {**_URING, **_CACHE},
        {"enter": f"{E.EAGAIN}:0:-1"},
        "io_uring_enter: EAGAIN",
    ),
    "enter-EAGAIN-mid-stays": (
        {**_URING, **_NO_CACHE},
        {"enter": f"{E.EAGAIN}:5:-1"},
        "io_uring_enter: EAGAIN",
    ),
    "enter-EBUSY-first-stays": ({**_URING, **_CACHE}, {"enter": f"{E.EBUSY}:0:-1"}, "io_uring_enter: EBUSY"),
    "enter-EBUSY-mid-passes": ({**_URING, **_CACHE}, {"enter": f"{E.EBUSY}:5:2"}, None),
    "enter-ENOMEM-first": ({**_URING, **_CACHE}, {"enter": f"{E.ENOMEM}:0:-1"}, "io_uring_enter: ENOMEM"),
    "enter-ENOMEM-mid": ({**_URING, **_CACHE}, {"enter": f"{E.ENOMEM}:5:-1"}, "io_uring_enter: ENOMEM"),
    "enter-ENOMEM-once-mid": (
        {**_URING, **_NO_CACHE},
        {"enter": f"{E.ENOMEM}:3:1"},
        "io_uring_enter: ENOMEM",
    ),
    "setup-fails": ({**_URING, **_CACHE}, {"setup": f"{E.ENOMEM}:0:-1"}, "io_uring_setup: ENOMEM"),
    "short-completions-direct": ({**_URING, **_CACHE}, {"cqe": "0:0:-1"}, None),
    "short-completions-plain": ({**_URING, **_NO_CACHE}, {"cqe": "0:0:-1"}, None),
    "short-preads": ({"PLE_UM_FILE_READS": "threads", **_NO_CACHE}, {"pread": "0:0:-1"}, None),
    "EIO-preads": ({"PLE_UM_FILE_READS": "threads", **_CACHE}, {"pread": f"{E.EIO}:10:7"}, None),
    "EIO-completions-retried": ({**_URING, **_CACHE}, {"cqe": f"{E.EIO}:10:7"}, None),
    "EIO-completions-and-preads": (
        {**_URING, **_CACHE},
        {"cqe": f"{E.EIO}:0:-1", "pread": f"{E.EIO}:10:7"},
        None,
    ),
}


# -- the lab: a process with the shim preloaded, running each scenario in a forked child ----------------
def _evict(mapping: MappedShards, layout) -> None:
    evict_pages(layout.files, mapping.regions)


def _scenario(spec: dict, shim_path: str, folder: str) -> dict:
    """One scenario (in a forked child of the lab): what happened, for the test to judge."""
    import ple_um
    from ple_um.synthetic import write_checkpoint

    os.environ.update({"PLE_UM_READ_DEPTH": "8", "PLE_UM_CPU_THREADS": "1", **spec["knobs"]})
    for what, value in spec["faults"].items():
        os.environ[f"SHIM_{what.upper()}"] = value
    shim = ctypes.CDLL(shim_path)
    shim.shim_hits.restype = ctypes.c_long
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("ple_um").addHandler(handler)
    rng = np.random.default_rng(spec["seed"])
    layout = write_checkpoint(
        Path(folder) / spec["name"],
        num_rows=ROWS,
        row_dim=ROW_DIM,
        dtype="fp8",
        shards=SHARDS,
        files=2,
        seed=spec["seed"],
    )
    S = layout.rows_per_shard
    owned = (S // 2, ROWS - S // 3)
    looked = []
    with ple_um.open_table(layout.directory, rows=owned, mode="cpu", device="cpu") as table:
        first = None
        for k in range(3):
            if k != 1:  # the second lookup asks the first one's ids again
                ids = rng.permutation(np.unique(boundary_ids(layout, rng, 1500, owned)))
                expect = reference_rows(layout, ids, owned)
            _evict(table.mapping, layout)
            if k == 0:
                shim.shim_arm()
            broken = table.stats()["broken_rows"]
            out = torch.full((len(ids), ROW_DIM), 0xAB, dtype=torch.uint8)
            look = threading.Thread(
                target=table.lookup,
                args=(torch.from_numpy(ids),),
                kwargs={"out": out.view(torch.float8_e4m3fn)},
            )
            if "setup" in spec["faults"]:  # a thread with no ring yet: the open made the caller's
                look.start()
                look.join()
            else:
                look.run()
            got = out.numpy()
            same, zero = (got == expect).all(1), ~got.any(1)
            looked.append(
                {
                    "rows": len(ids),
                    "wrong": int((~same & ~zero).sum()),
                    "zeroed": int((zero & ~same).sum()),
                    "broken": table.stats()["broken_rows"] - broken,
                }
            )
            first = first or table.stats()
        last = table.stats()
    return {
        "lookups": looked,
        "file_reader": first["file_reader"],
        "fallback": first["file_reader_fallback"],
        "file_reader_after": last["file_reader"],
        "warnings": sum("io_uring failed" in w for w in warned),
        "hits": {what: shim.shim_hits(k) for k, what in enumerate(FAULTS)},
        "reader_threads_left": reader_threads(),
    }


def _in_child(spec: dict, shim_path: str, folder: str) -> dict:
    """``_scenario`` in a forked child, killed past SCENARIO_SECONDS."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            result = {"error": None, **_scenario(spec, shim_path, folder)}
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            import traceback

            result = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    deadline, data = time.monotonic() + SCENARIO_SECONDS, b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return {"error": f"no answer in {SCENARIO_SECONDS} s: the scenario hangs"}
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return json.loads(data) if data else {"error": f"the scenario's process died (status {status})"}


def _lab(shim_path: str, folder: str) -> None:
    """The lab's loop: a scenario a line on stdin, its result a line on stdout."""
    from ple_um import envs

    rowcopy.load(envs.PLE_UM_CACHE_DIR)  # built once, here, not in each child
    print("READY", flush=True)
    for line in sys.stdin:
        print("RESULT " + json.dumps(_in_child(json.loads(line), shim_path, folder)), flush=True)


class Lab:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._wait_for("READY", LAB_START_SECONDS)

    def _wait_for(self, prefix: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.proc.stdout], [], [], left)[0], (
                f"the lab said nothing in {seconds} s"
            )
            line = self.proc.stdout.readline()
            assert line, f"the lab ended (exit {self.proc.wait()})"
            if line.startswith(prefix):
                return line[len(prefix) :]

    def run(self, spec: dict) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._wait_for("RESULT ", SCENARIO_SECONDS + 30))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reader-faults")
    shim = folder / "shim.so"
    (folder / "shim.c").write_text(SHIM_C)
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"  # as the row copy's build finds one
    done = subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-Wall", "-o", str(shim), str(folder / "shim.c"), "-ldl", "-pthread"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    tests = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLE_UM_") or k == "PLE_UM_CACHE_DIR"}
    preload = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(shim)]))  # a sanitizer's runtime first
    env.update(LD_PRELOAD=preload, PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]))
    with open(folder / "lab.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--lab", str(shim), str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        try:
            yield Lab(proc)
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_fault_of_the_reader_gives_exact_or_counted_zero_rows(lab, rng, name):
    knobs, faults, fallback = SCENARIOS[name]
    spec = {"name": name, "knobs": knobs, "faults": faults, "seed": int(rng.integers(1 << 30))}
    got = lab.run(spec)
    assert got["error"] is None, got["error"]
    for what in faults:
        assert got["hits"][what] > 0, f"the {what} fault never happened: {got['hits']}"
    looked = got["lookups"]
    assert all(look["wrong"] == 0 for look in looked), looked  # every row the files' row, or zeros
    assert all(look["zeroed"] == look["broken"] for look in looked), looked  # every zero row counted
    zeroed = got["hits"]["pread"] if faults.get("pread", "").startswith(f"{E.EIO}:") else 0
    assert [look["zeroed"] for look in looked] == [zeroed, 0, 0], looked  # never cached
    asked = knobs["PLE_UM_FILE_READS"]
    if fallback is None:
        assert (got["fallback"], got["file_reader"], got["warnings"]) == (None, asked, 0), got
    else:
        assert got["fallback"] is not None and fallback in got["fallback"], got
        assert (got["file_reader"], got["file_reader_after"], got["warnings"]) == ("threads", "threads", 1), (
            got
        )
    assert got["reader_threads_left"] == 0, got  # the reader threads joined when the table closed


# -- in this process ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lib():
    from ple_um import envs

    lib, why = rowcopy.load(envs.PLE_UM_CACHE_DIR)  # the session's: built once, for the lab too
    assert lib is not None, why
    return lib


def _run(lib, rows, ids: np.ndarray, rb: int) -> tuple[np.ndarray, dict]:
    counts = rowcopy.Counts()
    # Poisoned with NumPy: a torch fill this large would run on torch's OpenMP pool, which a
    # forked child of a process that already started it waits on for ever.
    out = torch.from_numpy(np.full((len(ids), rb), 0xAB, dtype=np.uint8))
    job = make_job([rows], torch.from_numpy(ids), [out], counts)
    lib.ple_lookup_run(ctypes.addressof(job))
    return out.numpy(), counts.read()


@pytest.mark.parametrize("strategy", ["uring", "threads"])
def test_a_truncation_without_a_row_cache_gives_counted_zero_rows_never_torn(
    lib, make_checkpoint, rng, strategy
):
    """Without a row cache, rows whose pages are resident are copied from the mapping. A file cut
    7 bytes into a row keeps the page its new end falls in resident, zeros past the end (and, on a
    filesystem of large folios, pages past it too, which SIGBUS when touched): the row cut and the
    rows after it are zero rows, counted as broken (6c), never a torn row, uncounted zeros or a
    SIGBUS; every row before the cut is exact. The lookup runs in a forked child (a SIGBUS fails
    the test, not the suite)."""
    layout = make_checkpoint(
        num_rows=3000, row_dim=ROW_DIM, dtype="fp8", shards=4, files=2, seed=int(rng.integers(1 << 30))
    )
    rb, victim = layout.row_bytes, layout.files[-1]
    shard = next(s for s in layout.shards if s.path == victim)
    cut_row = int(rng.integers(40, shard.rows - 40))
    cut = shard.offset + cut_row * rb + 7
    first = shard.index * layout.rows_per_shard
    near = np.arange(first + cut_row - 30, first + cut_row + 30)
    ids = rng.permutation(np.unique(np.concatenate([near, rng.integers(0, layout.num_rows, 600)])))
    expect = reference_rows(layout, ids)  # read before the cut: the cut's page now resident
    specs = {s.index: s for s in layout.shards}
    ends = np.array(
        [specs[i // layout.rows_per_shard].offset + (i % layout.rows_per_shard + 1) * rb for i in ids]
    )
    in_victim = np.array([specs[i // layout.rows_per_shard].path == victim for i in ids])
    lost = in_victim & (ends > cut)
    assert lost.sum() >= 30
    with MappedShards(layout) as mapping:
        reader = FileReader(mapping, strategy=strategy, direct=False, depth=16, resident_check=True, lib=lib)
        try:
            os.truncate(victim, cut)

            def look() -> bool:
                got, counts = _run(lib, rowcopy.Rows(mapping, reader=reader), ids, rb)
                torn = [int(k) for k in np.flatnonzero(lost) if got[k].any()]
                wrong = int((got[~lost] != expect[~lost]).any(1).sum())
                print(f"rows lost {int(lost.sum())}, counted {counts['broken']}, torn {torn}, wrong {wrong}")
                return not torn and wrong == 0 and counts["broken"] == int(lost.sum())

            assert in_forked_child(look) == 0
        finally:
            reader.close()


def test_the_reader_threads_stop_when_the_last_reader_closes(lib, make_checkpoint, rng):
    """Readers hold the library's reader threads: they run while one is open, and are joined when
    the last one closes; open, read and close cycles leave no thread and no descriptor behind."""
    layout = make_checkpoint(
        num_rows=4000, row_dim=64, dtype="fp8", shards=3, seed=int(rng.integers(1 << 30))
    )
    ids = rng.permutation(np.unique(rng.integers(0, layout.num_rows, 800)))
    expect = reference_rows(layout, ids)
    threads, fds = reader_threads(), len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with MappedShards(layout) as mapping:
            readers = [
                FileReader(mapping, strategy="threads", direct=False, depth=16, lib=lib) for _ in range(2)
            ]
            for k, reader in enumerate(readers):
                _evict(mapping, layout)
                got, counts = _run(lib, rowcopy.Rows(mapping, reader=reader), ids, layout.row_bytes)
                assert np.array_equal(got, expect) and counts["file_reads"] == len(ids)
                assert reader_threads() == threads + 15  # depth 16: 15 reader threads and the caller
                reader.close()
                assert reader_threads() == (threads + 15 if k == 0 else threads)  # joined with the last
        assert len(os.listdir("/proc/self/fd")) == fds


if __name__ == "__main__" and sys.argv[1:2] == ["--lab"]:
    _lab(sys.argv[2], sys.argv[3])


def test_the_alignment_probe_raises_what_failed_and_unmaps_its_buffer(tmp_path, monkeypatch):
    # memoryview() over the probe's buffer failing: that error is raised (not the probe's own), and
    # the buffer is unmapped.
    path = tmp_path / "rows"
    path.write_bytes(bytes(range(256)) * 64)
    made = []

    def tracked(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    def refused(obj):
        raise MemoryError("memoryview refused (injected)")

    real = file_reads.mmap.mmap
    monkeypatch.setattr(file_reads.mmap, "mmap", tracked)
    monkeypatch.setattr(file_reads, "memoryview", refused, raising=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(MemoryError, match="injected"):
            file_reads._direct_alignment(fd, 16384)
        assert len(made) == 1 and made[0].closed
        monkeypatch.undo()
        assert file_reads._direct_alignment(fd, 16384) == 512  # a buffered descriptor reads at 512
    finally:
        os.close(fd)
