"""The bench's start-up and memory figures: how long an open takes with the page cache cold and
warm, what it adds to the process, and the host memory several processes take for one table."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import torch

from ple_um.access.memory import mem_available
from ple_um.bench.config import open_ple_um
from ple_um.bench.contenders import VllmPinnedHost
from ple_um.bench.memlimit import memory_status
from ple_um.checkpoint import ShardLayout, read_engram_layout, read_layout
from ple_um.residency import evict_pages

# How long a ``processes`` child may take to open the table and say so before it counts as hung and
# is killed: an open copies at most the table once (vLLM's pinned copy), a few minutes for the
# largest tables at a GB/s, so a child silent for longer is stuck, not slow.
READY_TIMEOUT_S = 600.0
# The child: a fresh interpreter that opens the table and says its mode (``serve``).
CHILD = "import sys; from ple_um.bench.footprint import serve; serve(*sys.argv[1:])"


def read_cache(layout: ShardLayout) -> None:
    """Read every file of the table once, so that its pages are in the page cache."""
    for path in layout.files:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def rss_anon() -> int:
    """This process's anonymous resident bytes (RssAnon), 0 when unreadable."""
    return int(memory_status().get("RssAnon", "0 kB").split()[0]) * 1024


def startup(layout: ShardLayout, device: torch.device) -> dict:
    """An open of the table with its pages dropped, then with them all in the page cache: the
    mode, the seconds, and the GPU, anonymous and pinned bytes it adds."""
    out = {}
    for label in ("cold", "warm"):
        if label == "warm":
            read_cache(layout)
        else:  # the pages no process maps dropped (the files are only read: nothing to write back)
            evict_pages(layout.files, write_back=False)
        gpu0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        anon0 = rss_anon()
        t0 = time.perf_counter()
        with open_ple_um(layout, device) as table:
            seconds = time.perf_counter() - t0
            stats = table.stats()
            out[label] = {
                "mode": table.mode,
                "open_s": seconds,
                "gpu_bytes": (torch.cuda.memory_allocated(device) - gpu0) if device.type == "cuda" else 0,
                "anon_rss_added_bytes": rss_anon() - anon0,
                "pinned_bytes": stats["pinned_bytes"],
            }
    return out


def serve(directory: str, layer: str, kind: str, device: str, engram: str) -> None:
    """Child process (see ``processes``): open the table one way, print the mode it is served in,
    wait for stdin to close, close the table (``engram`` "1": an Engram table)."""
    dev = torch.device(device)
    layout = (read_engram_layout if engram == "1" else read_layout)(directory, int(layer))
    if kind == "ple-um":
        impl = open_ple_um(layout, dev)
        mode = impl.mode
    else:
        impl = VllmPinnedHost(layout, dev)
        mode = "pinned copy"
    print(mode, flush=True)
    sys.stdin.read()
    impl.close()


def ready_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The first line ``proc`` writes to its stdout (a binary pipe), without its newline: "" where
    the pipe closed first (it died), None where no whole line came within ``timeout_s``."""
    fd, got, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
    while b"\n" not in got:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return ""
        got += chunk
    return got.split(b"\n", 1)[0].decode().strip()


def processes(
    layout: ShardLayout, kind: str, count: int, device: torch.device, ready_s: float = READY_TIMEOUT_S
) -> dict:
    """Host memory as ``count`` processes open the same table one after the other (one TP1
    replica per GPU): MemAvailable before and after each is ready. The children are fresh
    interpreters (not multiprocessing's spawn, which re-runs the parent's main script where that
    lacks a ``__main__`` guard); one that dies before it is ready is reported, not waited for, and
    one not ready within ``ready_s`` seconds is killed and reported."""
    read_cache(layout)
    steps = [mem_available()]
    children: list[subprocess.Popen] = []
    mode = None
    argv = [sys.executable, "-c", CHILD, layout.directory, str(layout.layer), kind, str(device)]
    argv.append("1" if layout.is_mxfp8 else "0")
    try:
        for _ in range(count):
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            children.append(proc)
            mode = ready_line(proc, ready_s)
            if mode is None:
                proc.kill()
                return {"skipped": f"a {kind} process was not ready after {ready_s:g} s: killed"}
            if not mode:  # its stdout closed: it died before it was ready
                proc.wait()
                why = f"a {kind} process exited with {proc.returncode} before it was ready (its stderr above)"
                return {"skipped": why}
            steps.append(mem_available())
    finally:
        for proc in children:
            proc.stdin.close()
            proc.stdout.close()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    drops = [steps[0] - s for s in steps[1:]]
    return {"mode": mode, "mem_available_drop_bytes": drops}
