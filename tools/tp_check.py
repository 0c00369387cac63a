"""Tensor parallelism on two GPUs: each rank maps its vocab range of one FP8 table, every
rank looks up the same ids, an all-reduce sums the partial rows, and the sum must equal the rows
read from the files; and an Engram table split by heads, gathered across the ranks. Prints check
lines as it goes, the row cache's counts, a memory table and a timing table last, and writes JSON.

    python tools/tp_check.py --size 16GiB                        # spawns 2 ranks, NCCL, GPUs 0 and 1
    python tools/tp_check.py --size 16GiB --row-cache 2GiB --memory-limit 10GiB   # issue 47's run
    torchrun --nproc-per-node 2 tools/tp_check.py --size 16GiB    # the same under torchrun (no limit)
    python tools/tp_check.py --backend gloo --device cpu --size 32MiB   # dry run on the CPU

What it does, for each way of opening the table (both ranks `registered`, both `cpu`, and rank 0
`registered` with the others `cpu`, as a pin budget could decide):
1. Opens the table on every rank with ``rows=`` its vocab range, split as vLLM's
   VocabParallelEmbedding splits the org vocab (the table has a multiple of 64 rows, as
   ``make_ngram_vocab_size_divisible_by`` makes it; the split falls inside a shard). Modes are
   forced; PLE_UM_PIN_BUDGET, when unset, is set to the table's bytes.
2. Looks up ids of each of the bench's distributions (--distributions: uniform, zipf:1.1 and
   trace, drawn by ``ple_um.bench.ids``), and ids with every bad kind (negative, >= num_rows, the
   split's edges),
   all-reduces the raw FP8 rows as int8 (as vLLM's stock backend sums them) and the dequantized
   bf16 rows, and compares with the rows read from the files by this script (its own safetensors
   header parse, plain reads): bytes for the int8 sums, values for bf16 (the owner's -0.0 plus the
   other ranks' +0.0 is +0.0: those are the only bits allowed to differ). Each rank's rows before
   the all-reduce must be its own rows bit for bit, zeros elsewhere; the device counters must
   count every lookup.
3. Captures lookup + all-reduce in a CUDA graph per rank when every rank's table reports
   ``capture_safe`` (else says which is not), and checks every replay, each with new ids.
   Early lookups: a step whose lookup is forked onto ple-um's side stream at its start
   (``served.SideLookups``, as the engines' early lookups), the step's other work meanwhile, joined
   where the rows are used (the all-reduce): eager, and captured whole in a graph. Without CUDA the
   same step runs with no stream (the lookup inline), eager only; the JSON says so.
4. Memory: pinned bytes per rank against the span of the shards its range touches, computed from
   the file headers; each rank's anonymous and file-backed resident memory (/proc/self/status,
   /proc/self/smaps_rollup), the table's pages in the page cache (mincore) and the host's page
   cache (/proc/meminfo, which other work on the host also moves) before and after every rank
   opened, the table's pages dropped from the page cache first and prewarmed at open
   (PLE_UM_PREWARM=1): the table's cached pages grow by one table for all ranks together.
5. Times a step (lookup + all-reduce; CUDA events, fresh ids every call, median and p10-p90),
   eager and replayed, next to one GPU holding the whole table (torch.index_select on a resident
   copy on rank 0 alone, no all-reduce).
6. --row-cache SIZE: every mode set again ("+ row cache") with PLE_UM_ROW_CACHE=SIZE per rank and
   no prewarm, the table's pages dropped first: rows come from the row cache and the reader of
   misses; a ``cpu`` rank's cache must have hit and missed and the reader read the files. Every
   pass's row cache counts (hits, misses, reads) per rank are in the report and the JSON.
7. --memory-limit SIZE: each rank in a memory cgroup of its own (``ple_um.bench.memlimit``, made
   by the launcher, joined by the rank before its work; not under torchrun), page cache included;
   where none can be made, a skipped check says why and the run goes on without. A registered
   rank's pinned rows are charged to its group: a mode set whose pins do not fit (with PIN_ROOM)
   is skipped, saying so. Each group's peak is reported.
8. --engram-size SIZE: a DeepSeek-V4.1 Engram table (``ple_um.synthetic_engram``: 8 hash heads,
   MXFP8) split by heads as ``ple_um.vllm.engram`` splits it: each rank opens the rows of its heads
   (``open_engram_table``), looks up its heads' columns of the same hashes, and the heads gathered
   across the ranks (all_gather) must equal the whole table's rows decoded from the file, bit for
   bit, eager and (GPU) replayed in a CUDA graph of lookup + all_gather.

The ranks run with NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1: no NVLink multicast, which the check does not need and which on a shared
host can take its GPUs out of service. A watchdog ends a rank that runs past --timeout, and NCCL
teardown gets its own --teardown-timeout (the teardown of spawned ranks can hang after their work
is done). Exit code: 0 all checks passed, 1 a check failed, 2 an error,
124 the watchdog.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import mmap
import os
import re
import shutil
import socket
import struct
import sys
import threading
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from ple_um import envs, units
from ple_um.residency import evict_pages

# No NVLink multicast (NVLS: on a shared host it can take the GPUs out of service, and the check needs
# none); set in every rank before NCCL starts.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE; Qwen4Exp's divisor is a multiple of the TP size
LAYER = 1
SHARD_NAME = re.compile(r"layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
SCALE_NAME = re.compile(r"layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.weight_scale$")
BAD_IDS = (-1, -2, -7, -(1 << 40), 1 << 40, 1 << 62)  # plus num_rows, num_rows + 1, num_rows + 7
READ_CHUNK = 256 << 20
RAW, BF16 = "fp8 as int8", "bf16"
PIN_ROOM = 1 << 30  # a rank's memory beyond its pinned rows under --memory-limit (CUDA, buffers, torch)


def log(who: str, text: str) -> None:
    # One write a line: the ranks share the terminal, and print's separate newline lets lines mix.
    sys.stdout.write(f"[tp_check {who}] {text}\n")
    sys.stdout.flush()


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


# -- the table's shape, the vocab split, the files -------------------------------------------------
def vocab_ranges(num_rows: int, world: int) -> list[tuple[int, int]]:
    """Each rank's org-vocab rows as vLLM's VocabParallelEmbedding splits them: the vocab padded to
    VOCAB_PADDING, split evenly, the padding removed."""
    padded = -(-num_rows // VOCAB_PADDING) * VOCAB_PADDING
    if padded % world:
        raise ValueError(f"{padded} padded rows do not split over {world} ranks (vLLM would refuse too)")
    per = padded // world
    return [(min(r * per, num_rows), min((r + 1) * per, num_rows)) for r in range(world)]


def table_shape(size: int, row_bytes: int, shards: int, world: int) -> int:
    """Rows of the table: size / row_bytes, a multiple of VOCAB_PADDING, less a few padding steps
    until no split point falls on a shard boundary."""
    top = size // row_bytes // VOCAB_PADDING * VOCAB_PADDING
    for rows in range(top, max(top - 16 * VOCAB_PADDING, 0), -VOCAB_PADDING):
        per_shard = -(-rows // shards)
        if all(start % per_shard for start, _ in vocab_ranges(rows, world)[1:]):
            return rows
    raise ValueError(
        f"every table of about {size} bytes in {shards} shards puts a split point of {world} ranks on "
        f"a shard boundary: pick another --shards (an odd count, say) or a larger --size"
    )


def prepare_table(args, who: str) -> tuple[str, dict]:
    """The table's directory: --dir as it is when it holds a table, else the synthetic table of
    --size written there (or under PLE_UM_CACHE_DIR, named by its shape, and reused) with
    threads in large chunks and written back to disk. Several ranks may call this at once
    (torchrun): a lock file lets one write while the others wait."""
    rows = table_shape(args.size, args.row_bytes, args.shards, args.world)
    default = os.path.join(envs.PLE_UM_CACHE_DIR, f"tp_check-fp8-{rows}x{args.row_bytes}-{args.shards}")
    directory = (args.dir or default).rstrip("/")
    os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    with open(directory + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            found = FileTable(directory)
        except (OSError, ValueError, KeyError):
            found = None
        if found is not None and (args.dir or found.num_rows == rows):
            return directory, {"written": False, "seconds": 0.0}
        if args.dir and os.path.isdir(args.dir) and os.listdir(args.dir):
            raise ValueError(
                f"--dir {args.dir} holds no FP8 PLE table this script can read; not writing over it"
            )
        from ple_um.synthetic import write_checkpoint

        t0 = time.perf_counter()
        partial = directory + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        write_checkpoint(
            partial,
            num_rows=rows,
            row_dim=args.row_bytes,
            dtype="F8_E4M3",
            shards=args.shards,
            workers=args.write_workers,
            progress=True,
            write_back=True,  # written back now, not while lookups are timed
        )
        shutil.rmtree(directory, ignore_errors=True)  # a broken table of ours, or an empty --dir
        os.rename(partial, directory)
        seconds = time.perf_counter() - t0
        log(who, f"wrote {gib(rows * args.row_bytes)} ({rows} rows) in {seconds:.1f} s to {directory}")
        return directory, {"written": True, "seconds": seconds}


class FileTable:
    """The PLE table as its files hold it, found with this script's own safetensors header parse
    (not ple_um's reader) and read with plain reads: the reference every lookup is compared with."""

    def __init__(self, directory: str, layer: int = LAYER) -> None:
        with open(os.path.join(directory, "model.safetensors.index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        shards: dict[int, tuple[str, int, int, int]] = {}  # index -> (path, file offset, rows, bytes a row)
        self.scale = None
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
                for tensor, meta in header.items():
                    if tensor == "__metadata__":
                        continue
                    begin, end = meta["data_offsets"]
                    shard = SHARD_NAME.search(tensor)
                    if shard and int(shard[1]) == layer:
                        if meta["dtype"] != "F8_E4M3":
                            raise ValueError(f"{tensor} in {path} is {meta['dtype']}, not F8_E4M3")
                        rows, width = meta["shape"]
                        shards[int(shard[2])] = (path, 8 + length + begin, rows, width)
                    elif SCALE_NAME.search(tensor) and int(SCALE_NAME.search(tensor)[1]) == layer:
                        f.seek(8 + length + begin)
                        (self.scale,) = struct.unpack("<f", f.read(end - begin))
        self.parts = len(shards)
        if sorted(shards) != list(range(self.parts)) or self.scale is None:
            raise ValueError(f"{directory}: shards {sorted(shards)} or the scale missing for layer {layer}")
        self.shards = [shards[i] for i in range(self.parts)]
        self.files = [os.path.join(directory, name) for name in files]
        self.row_bytes = self.shards[0][3]
        self.rows_per_shard = self.shards[0][2]
        self.num_rows = sum(s[2] for s in self.shards)
        for i, (path, _, rows, width) in enumerate(self.shards):
            if width != self.row_bytes or i * self.rows_per_shard + rows > self.num_rows:
                raise ValueError(f"shard {i} of {path}: {rows} x {width} does not fit the table")

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    def load(self, device: torch.device) -> torch.Tensor:
        """Every row, uint8 [num_rows, row_bytes], on ``device`` (read in chunks through one host buffer)."""
        table = torch.empty((self.num_rows, self.row_bytes), dtype=torch.uint8, device=device)
        flat = table.view(-1)
        host = flat if device.type == "cpu" else torch.empty(READ_CHUNK, dtype=torch.uint8, pin_memory=True)
        for i, (path, offset, rows, _) in enumerate(self.shards):
            first = i * self.rows_per_shard * self.row_bytes
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                for pos in range(0, rows * self.row_bytes, READ_CHUNK):
                    n = min(READ_CHUNK, rows * self.row_bytes - pos)
                    view = flat[first + pos : first + pos + n] if host is flat else host[:n]
                    got = f.readinto(memoryview(view.numpy()))
                    if got != n:
                        raise ValueError(f"short read of shard {i} in {path}: {got} of {n} bytes")
                    if host is not flat:
                        flat[first + pos : first + pos + n].copy_(view)
        return table

    def pinned_span(self, start: int, end: int) -> tuple[int, list[int]]:
        """Bytes a registration of rows [start, end) covers, from the headers alone: per file, per
        run of owned row ranges with no other rank's rows between them (a file's shards lie in name
        order, shard_1, shard_10, ..., so a rank's may lie apart), the bytes from the run's first
        owned row (rounded down to a page) to the end of its last one; and the shards the range
        touches."""
        owned: dict[str, list[tuple[int, int]]] = {}
        foreign: dict[str, list[tuple[int, int]]] = {}
        touched = []
        for i, (path, offset, rows, _) in enumerate(self.shards):
            first = i * self.rows_per_shard
            lo = min(max(start - first, 0), rows)
            hi = max(min(end - first, rows), lo)
            a, b = offset + lo * self.row_bytes, offset + hi * self.row_bytes
            foreign.setdefault(path, []).extend([(offset, a), (b, offset + rows * self.row_bytes)])
            if hi > lo:
                touched.append(i)
                owned.setdefault(path, []).append((a, b))
        total = 0
        for path, ranges in owned.items():
            runs: list[list[int]] = []
            for a, b in sorted(ranges):
                if runs and not any(x < a and runs[-1][1] < y for x, y in foreign[path] if y > x):
                    runs[-1][1] = b
                else:
                    runs.append([a, b])
            total += sum(hi - lo // mmap.PAGESIZE * mmap.PAGESIZE for lo, hi in runs)
        return total, touched

    def drop_cache(self) -> None:
        """Write back and evict the files' pages (the pages no process maps)."""
        evict_pages(self.files)


# -- the ids ------------------------------------------------------------------------------------------
def id_distributions(text: str) -> tuple:
    """The bench's id distributions named in ``text`` (uniform, zipf:S, trace: each with ``name`` and
    ``draw(rng, num_rows, n)``); the one place this script takes them from the package."""
    from ple_um.bench.ids import parse_ids

    return parse_ids(text)


# -- the Engram table ---------------------------------------------------------------------------------
ENGRAM_LAYER, ENGRAM_DIM, ENGRAM_ORDERS, ENGRAM_HEADS = 3, 256, 2, 4  # 2-grams and 3-grams, 4 heads each
ENGRAM_ROW_BYTES = ENGRAM_DIM + ENGRAM_DIM // 32  # E4M3 values and their E8M0 block scales


def engram_rows(size: int) -> int:
    return size // ENGRAM_ROW_BYTES


def engram_geometry(rows: int):
    """The geometry (``EngramGeometry``) of a DeepSeek-V4.1-shaped table of ``rows`` rows: 8 hash
    heads whose prime-sized ranges fill it but for a few hundred rows; ValueError for a table too
    small to hold them."""
    from engram_config import geometry_from_config

    heads = ENGRAM_ORDERS * ENGRAM_HEADS
    vocab = rows // heads - 256  # the primes lie just above it: 8 ranges a little longer than vocab
    if vocab < 64:
        raise ValueError(f"an Engram table of {rows} rows is too small for {heads} heads (--engram-size)")
    config = {
        "engram_layer_ids": [ENGRAM_LAYER],
        "engram_num_embeddings": [rows],
        "engram_max_ngram_size": ENGRAM_ORDERS + 1,
        "engram_n_heads": ENGRAM_HEADS,
        "engram_head_dim": ENGRAM_DIM,
        "engram_vocab_size": vocab,
    }
    return geometry_from_config(config)


def prepare_engram(args, who: str) -> str | None:
    """The Engram table's directory under PLE_UM_CACHE_DIR, named by its rows, written once
    (``ple_um.synthetic_engram``) and reused; None without --engram-size."""
    if not args.engram_size:
        return None
    rows = engram_rows(args.engram_size)
    directory = os.path.join(envs.PLE_UM_CACHE_DIR, f"tp_check-engram-{rows}x{ENGRAM_DIM}")
    os.makedirs(envs.PLE_UM_CACHE_DIR, exist_ok=True)
    with open(directory + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if EngramFiles(directory).num_rows == rows:
                return directory
        except (OSError, ValueError, KeyError):
            pass
        from ple_um.synthetic_engram import write_engram_checkpoint

        t0 = time.perf_counter()
        shutil.rmtree(directory, ignore_errors=True)
        write_engram_checkpoint(directory, tables={ENGRAM_LAYER: rows}, head_dim=ENGRAM_DIM, write_back=True)
        log(
            who,
            f"wrote an Engram table of {gib(rows * ENGRAM_ROW_BYTES)} in {time.perf_counter() - t0:.1f} s",
        )
        return directory


class EngramFiles:
    """The Engram table as its file holds it (this script's own header parse, plain reads): values
    uint8 [rows, D] and E8M0 exponents uint8 [rows, D/32], decoded as vLLM decodes them."""

    def __init__(self, directory: str) -> None:
        with open(os.path.join(directory, "model.safetensors.index.json")) as f:
            (name,) = set(json.load(f)["weight_map"].values())
        self.path = os.path.join(directory, name)
        with open(self.path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        self.tensors = {}
        for kind in ("weight", "scale"):
            meta = header[f"model.layers.{ENGRAM_LAYER}.engram.embed.{kind}"]
            self.tensors[kind] = (8 + length + meta["data_offsets"][0], meta["shape"])
        self.num_rows, self.dim = self.tensors["weight"][1]

    def load(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        found = []
        for offset, shape in self.tensors.values():
            data = np.fromfile(self.path, dtype=np.uint8, count=shape[0] * shape[1], offset=offset)
            found.append(torch.from_numpy(data.reshape(shape)).to(device))
        return found[0], found[1]

    @staticmethod
    def decode(values: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        """bf16 of float32(e4m3) * 2^(e - 127), the scale's float32 bits ``e << 23`` (e = 0: zero)."""
        scales = (exponents.to(torch.int32) << 23).view(torch.float32)
        rows = values.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, 32))
        return (rows * scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


# -- memory -------------------------------------------------------------------------------------------
def _kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    found = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    found[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return found


def process_memory() -> dict[str, int]:
    """This process's resident memory by kind (bytes): status' RssAnon / RssFile / RssShmem and
    smaps_rollup's Rss, Pss, Pss_Anon, Pss_File."""
    status = _kib_fields("/proc/self/status", ("RssAnon", "RssFile", "RssShmem"))
    rollup = _kib_fields("/proc/self/smaps_rollup", ("Rss", "Pss", "Pss_Anon", "Pss_File"))
    return {**status, **{f"smaps_{k}": v for k, v in rollup.items()}}


def system_memory(directory: str | None) -> dict[str, int]:
    """The host's MemAvailable, Cached and MemFree (/proc/meminfo), and ``TableCached``: the PLE
    table's own pages in the page cache (mincore over a fresh read-only mapping; reads no data;
    none for ``directory`` None). Cached counts every file on the host, so on a shared machine
    other work moves it by more than a small table's bytes; TableCached counts only the table."""
    from ple_um.operating import residency

    found = _kib_fields("/proc/meminfo", ("MemAvailable", "Cached", "MemFree"))
    if directory is not None:
        found["TableCached"] = residency(directory)["total"]["resident_bytes"]
    return found


def all_gather(out: torch.Tensor, part: torch.Tensor) -> None:
    """Every rank's ``part`` into ``out`` [world * len(part), ...], rank after rank (one collective
    a CUDA graph can capture; torch 2.14 names it all_gather_single)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, part)


# -- one rank --------------------------------------------------------------------------------------------
class Rank:
    """One rank's share of the run: its checks, timings and memory readings, all kept in lockstep
    with the other ranks (every collective is called by every rank in the same order)."""

    def __init__(
        self, rank: int, world: int, args, device: torch.device, directory: str, joined: str | None = None
    ) -> None:
        self.rank, self.world, self.args, self.device, self.dir = rank, world, args, device, directory
        self.who = f"r{rank}"
        self.cuda = device.type == "cuda"
        self.checks: list[dict] = []
        self.timings: list[dict] = []
        self.memory: dict[str, dict] = {}
        self.tables: dict[str, dict] = {}
        self.expected = {"rows": 0, "out_of_range": 0}
        self.joined = joined
        self.dists = id_distributions(args.distributions)
        self.row_cache_knob = os.environ.get("PLE_UM_ROW_CACHE")
        self.row_cache: dict[str, dict] = {}
        self.engram: dict = {}

    # -- bookkeeping ------------------------------------------------------------------------------------
    def record(self, name: str, ok: bool | None, detail: str = "") -> None:
        status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        self.checks.append({"name": name, "rank": self.rank, "status": status, "detail": detail})
        log(self.who, f"{status} {name}{' -- ' + detail if detail else ''}")

    def gather(self, obj):
        """Every rank's ``obj``, in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- the memory limit ------------------------------------------------------------------------------
    def check_memory_group(self) -> None:
        """With --memory-limit: this rank is in the memory cgroup made for it (its pid in the group's
        cgroup.procs), or the reason there is none."""
        if self.args.memory_limit is None:
            return
        group = self.args.memory_groups[self.rank]
        name = f"memory limit: this rank in a memory cgroup of its own of {gib(self.args.memory_limit)}"
        if not group["enforced"]:
            self.record(name, None, f"the run goes on without the limit: {group['how']}")
            return
        try:
            with open(os.path.join(group["group"], "cgroup.procs")) as f:
                inside = str(os.getpid()) in f.read().split()
        except OSError as exc:
            inside, self.joined = False, self.joined or f"cannot read its cgroup.procs: {exc.strerror}"
        self.record(
            name, inside and self.joined is None, "; ".join(filter(None, (group["how"], self.joined)))
        )

    def memory_limit(self) -> dict | None:
        """This rank's memory limit (the launcher's description) and the most its group held."""
        group = self.args.memory_groups[self.rank]
        if group is None or not group["enforced"]:
            return group and {**group, "peak_bytes": None}
        peak = None
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                with open(os.path.join(group["group"], name)) as f:
                    peak = int(f.read())
                break
            except (OSError, ValueError):
                continue
        return {**group, "peak_bytes": peak}

    # -- ids and the reference ------------------------------------------------------------------------
    def ids(self, key: tuple, n: int, bad: bool, drawn=None) -> torch.Tensor:
        """The same ids on every rank (a generator seeded by the run's seed and ``key``): uniform in
        the table, or with every bad kind and the split's edges mixed in, or ``drawn`` from one of
        the bench's distributions (a trace's replay steps on with each call, in the same order on
        every rank)."""
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        if drawn is not None:
            rng = np.random.default_rng(int.from_bytes(digest, "little"))
            return torch.from_numpy(drawn.draw(rng, self.files.num_rows, n)).to(self.device)
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        ids = torch.randint(0, self.files.num_rows, (n,), generator=g)
        if bad:
            V, S = self.files.num_rows, self.files.rows_per_shard
            edges = [0, V - 1]
            for start, _ in self.ranges[1:]:
                shard = start // S
                edges += [start - 1, start, start + 1, shard * S - 1, shard * S, (shard + 1) * S]
            extra = torch.tensor(edges + [V, V + 1, V + 7, *BAD_IDS], dtype=torch.int64)[:n]
            ids[: extra.numel()] = extra
            ids = ids[torch.randperm(n, generator=g)]
        return ids.to(self.device)

    def want(self, ids: torch.Tensor, owned: tuple[int, int] | None = None) -> torch.Tensor:
        """uint8 rows of ``ids`` from the files; zeros outside the table (and outside ``owned``)."""
        lo, hi = owned or (0, self.files.num_rows)
        keep = (ids >= lo) & (ids < hi)
        rows = self.ref.index_select(0, torch.where(keep, ids, 0))
        rows[~keep] = 0
        return rows

    def dequant(self, raw: torch.Tensor) -> torch.Tensor:
        """float32(row) * scale, as bf16: what a lookup with out_dtype=bf16 must return."""
        return (raw.view(torch.float8_e4m3fn).float() * self.scale).to(torch.bfloat16)

    def compare(self, got: torch.Tensor, ids: torch.Tensor, out: str, reduced: bool = True) -> str | None:
        """None when ``got`` (a rank's rows, or their sum when ``reduced``) holds the right rows,
        else what differs. Bytes for raw rows; for bf16 sums values, with bit differences allowed
        only where the file's value is -0.0 and the sum +0.0."""
        raw = self.want(ids, None if reduced else self.ranges[self.rank])
        if out == RAW:
            differ = (got.view(torch.uint8) != raw).any(dim=1)
            return f"{int(differ.sum())} of {ids.numel()} rows differ" if differ.any() else None
        want = self.dequant(raw)
        a, b = got.view(torch.int16), want.view(torch.int16)
        bits = a != b
        if not reduced:
            return f"{int(bits.any(dim=1).sum())} rows differ in their bits" if bits.any() else None
        if not torch.equal(got, want):
            return f"{int((got != want).any(dim=1).sum())} of {ids.numel()} rows differ in value"
        stray = bits & ~((b == -32768) & (a == 0))  # -0.0 in the file, +0.0 in the sum
        return (
            f"{int(stray.sum())} elements differ in their bits beyond -0.0 -> +0.0" if stray.any() else None
        )

    def buffer(self, n: int, out: str, poison: bool = True) -> torch.Tensor:
        dtype = torch.float8_e4m3fn if out == RAW else torch.bfloat16
        buf = torch.empty((n, self.files.row_bytes), dtype=dtype, device=self.device)
        if poison:
            buf.view(torch.uint8).fill_(0xAB) if out == RAW else buf.fill_(float("nan"))
        return buf

    def step(self, table, ids: torch.Tensor, buf: torch.Tensor, out: str) -> None:
        """One TP step: this rank's rows (zeros for ids it does not own), summed over the ranks."""
        table.lookup(ids, out=buf)
        dist.all_reduce(buf.view(torch.int8) if out == RAW else buf)

    def count(self, ids: torch.Tensor) -> None:
        self.expected["rows"] += ids.numel()
        self.expected["out_of_range"] += int(((ids < 0) | (ids >= self.files.num_rows)).sum())

    # -- timing ------------------------------------------------------------------------------------------
    def timed(self, fn, together: bool = True) -> float:
        """Microseconds of fn() from an idle device (CUDA events; perf_counter on the CPU), every
        rank starting together unless ``together`` is False (rank 0 alone)."""
        self.sync()
        if together:
            dist.barrier()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def keep_time(self, label: str, n: int, out: str, how: str, us: list[float]) -> None:
        q = np.quantile(us[self.args.warmup :], [0.1, 0.5, 0.9])
        self.timings.append(
            {
                "modes": label,
                "rank": self.rank,
                "ids": n,
                "out": out,
                "how": how,
                "median_us": float(q[1]),
                "p10_us": float(q[0]),
                "p90_us": float(q[2]),
                "calls": len(us) - self.args.warmup,
            }
        )

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> dict:
        args = self.args
        seed = [args.seed if args.seed is not None else time.time_ns() % (1 << 31)]
        dist.broadcast_object_list(seed, src=0)
        self.seed = seed[0]
        self.check_memory_group()
        self.files = FileTable(self.dir)
        self.ranges = vocab_ranges(self.files.num_rows, self.world)
        self.scale = torch.tensor(self.files.scale, dtype=torch.float32, device=self.device)
        t0 = time.perf_counter()
        self.ref = self.files.load(self.device)
        log(
            self.who,
            f"read the whole table from the files onto {self.device} in {time.perf_counter() - t0:.1f} s",
        )
        S = self.files.rows_per_shard
        splits = [start for start, _ in self.ranges[1:]]
        self.record(
            "vocab split falls inside shards",
            all(s % S for s in splits),
            f"ranges {self.ranges}, {S} rows a shard: split rows {splits} lie in shards "
            f"{[s // S for s in splits]}",
        )
        # Each mode is forced here. On a host whose memory grows as it is used, MemAvailable reads
        # small at start, so the default budget (a fraction of MemAvailable) could refuse registered
        # mode for no reason this check is about; an explicit budget is kept.
        os.environ.setdefault("PLE_UM_PIN_BUDGET", str(self.files.nbytes))
        self.pin_budget = os.environ["PLE_UM_PIN_BUDGET"]
        everyone = lambda mode: [mode] * self.world  # noqa: E731
        mode_sets = (everyone("registered"), everyone("cpu"), ["registered"] + ["cpu"] * (self.world - 1))
        caches = [None] if args.row_cache is None else [None, args.row_cache]
        for cache in caches:
            for modes in mode_sets:
                label = "/".join(modes) + ("" if cache is None else " + row cache")
                if not self.cuda and "registered" in modes:
                    self.record(
                        f"{label}: whole run", None, "registered needs a CUDA device (dry run: cpu mode only)"
                    )
                    continue
                refused = self.pins_refused(modes)
                if refused:
                    self.record(f"{label}: whole run", None, refused)
                    continue
                self.run_modes(label, modes, cache)
        self.check_engram()
        self.anchor()
        return {
            "rank": self.rank,
            "checks": self.checks,
            "timings": self.timings,
            "memory": self.memory,
            "tables": self.tables,
            "row_cache": self.row_cache,
            "memory_limit": self.memory_limit(),
            "engram": self.engram,
            "seed": self.seed,
            "range": self.ranges[self.rank],
            "pin_budget": self.pin_budget,
        }

    def pins_refused(self, modes: list[str], spans: list[int] | None = None) -> str | None:
        """Why ``modes`` cannot run under the ranks' memory limits, or None: a registered rank pins
        its rows' span (``spans``, by rank; default: the PLE table's), charged to its group, and a
        group that cannot hold them (with PIN_ROOM for the rest of the rank) has the rank killed,
        not the registration refused. The same answer on every rank (from the headers and the
        launcher's limits)."""
        spans = spans or [self.files.pinned_span(*r)[0] for r in self.ranges]
        for r, (mode, group, span) in enumerate(zip(modes, self.args.memory_groups, spans, strict=True)):
            if mode != "registered" or group is None or not group["enforced"]:
                continue
            if group["limit"] < span + PIN_ROOM:
                return (
                    f"rank {r} would pin {gib(span)} of rows under its memory limit of {gib(group['limit'])} "
                    f"(at least {gib(PIN_ROOM)} more needed for the rest of the rank)"
                )
        return None

    def knobs(self, cache: int | None) -> None:
        """The row cache pass: PLE_UM_ROW_CACHE of ``cache`` and no prewarm, so that the rows come
        from the reader of misses; the other passes: every rank reads its rows into the page cache
        at open (PLE_UM_PREWARM=1), the row cache as the environment set it."""
        if cache is None:
            os.environ["PLE_UM_PREWARM"] = "1"
            if self.row_cache_knob is None:
                os.environ.pop("PLE_UM_ROW_CACHE", None)
            else:
                os.environ["PLE_UM_ROW_CACHE"] = self.row_cache_knob
        else:
            os.environ.update(PLE_UM_PREWARM="0", PLE_UM_ROW_CACHE=str(cache))

    def run_modes(self, label: str, modes: list[str], cache: int | None) -> None:
        import ple_um

        mode = modes[self.rank]
        self.knobs(cache)
        self.sync()
        dist.barrier()
        if self.rank == 0:
            self.files.drop_cache()
        dist.barrier()
        before = (process_memory(), system_memory(self.dir))
        table, error = None, None
        try:
            table = ple_um.open_table(self.dir, rows=self.ranges[self.rank], mode=mode, device=self.device)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check; the other ranks go on
            error = f"{type(exc).__name__}: {exc}"
        self.sync()
        dist.barrier()
        after = (process_memory(), system_memory(self.dir))
        errors = self.gather(error)
        if error is not None or table.mode != mode:
            self.record(
                f"{label}: open rows={self.ranges[self.rank]} mode={mode}", False, error or table.mode
            )
        else:
            self.record(
                f"{label}: open rows={self.ranges[self.rank]} mode={mode}",
                True,
                f"{table.open_seconds:.2f} s, bulk_rows={table.bulk_rows}, capture_safe={table.capture_safe}",
            )
        if any(e is not None for e in errors):
            if table is not None:
                table.close()
            return
        try:
            self.expected = {"rows": 0, "out_of_range": 0}
            self.check_memory(label, table, before, after, prewarmed=cache is None)
            self.check_lookups(label, table)
            self.time_eager(label, table)
            self.check_early(label, table)
            self.check_graphs(label, table, modes)
            self.check_graphs(label, table, modes, early=True)
            stats = table.stats()
            got = {k: stats[k] for k in self.expected}
            self.record(f"{label}: device counters count every lookup", got == self.expected, f"{got}")
            self.check_row_cache(label, stats, cache)
        finally:
            table.close()

    def check_memory(self, label: str, table, before, after, prewarmed: bool = True) -> None:
        (proc0, sys0), (proc1, sys1) = before, after
        lo, hi = self.ranges[self.rank]
        owned = (hi - lo) * self.files.row_bytes
        span, touched = self.files.pinned_span(lo, hi)
        stats = table.stats()
        expect = span if table.mode == "registered" else 0
        self.record(
            f"{label}: pinned bytes == the span of the shards its rows touch",
            stats["pinned_bytes"] == expect,
            f"pinned {stats['pinned_bytes']}, expected {expect} (shards {touched[0]}-{touched[-1]}; its rows "
            f"{owned} B, the whole table {self.files.nbytes} B)",
        )
        mine = {
            "mode": table.mode,
            "pinned_bytes": stats["pinned_bytes"],
            "expected_pinned_bytes": expect,
            "owned_bytes": owned,
            "mapped_bytes": stats["mapped_bytes"],
            "before": proc0,
            "after": proc1,
            "growth": {k: proc1.get(k, 0) - proc0.get(k, 0) for k in proc1},
        }
        anon = mine["growth"].get("RssAnon", 0)
        cache = stats["row_cache"]["resident_bytes"] if stats["row_cache"] else 0  # rows looked up, kept
        self.record(
            f"{label}: anonymous memory but the row cache grew by less than a quarter of its rows (no copy)",
            anon - cache < owned / 4,
            f"RssAnon {gib(anon)} (the row cache's {gib(cache)}), file-backed RssFile "
            f"{gib(mine['growth'].get('RssFile', 0))}; its rows {gib(owned)}",
        )
        ranks = self.gather(mine)
        system = {
            "before": sys0,
            "after": sys1,
            "growth": {k: sys1.get(k, 0) - sys0.get(k, 0) for k in sys1},
        }
        self.memory[label] = {"ranks": ranks, "system": system, "table_bytes": self.files.nbytes}
        self.tables[label] = {
            "mode": table.mode,
            "bulk_rows": table.bulk_rows,
            "open_seconds": table.open_seconds,
        }
        if self.rank == 0:
            name = f"{label}: host memory grew by one table for all ranks (page cache shared)"
            if not prewarmed:
                self.record(name, None, "the row cache pass: no prewarm, misses read into the row cache")
                return
            table_bytes = self.files.nbytes
            table_cached = system["growth"].get("TableCached", 0) / table_bytes
            cached = system["growth"].get("Cached", 0) / table_bytes
            files = sum(r["growth"].get("RssFile", 0) for r in ranks) / table_bytes
            ok = 0.9 < table_cached <= 1.0 and files > 0.9
            limits = [g["limit"] for g in self.args.memory_groups if g is not None and g["enforced"]]
            held = bool(limits) and min(limits) < owned  # the limit, not a copy, bounds the page cache
            self.record(
                name,
                None if held and not ok else ok,
                f"the table's pages in the page cache {table_cached:+.2f} tables, the ranks' "
                f"file-backed resident memory together {files:+.2f} tables; the host's page cache "
                f"{cached:+.2f} tables and MemAvailable {gib(system['growth'].get('MemAvailable', 0))}, "
                f"other work included (one table: {gib(table_bytes)})"
                + (f"; a rank's memory limit {gib(min(limits))} is below its rows" if held else ""),
            )

    def check_lookups(self, label: str, table) -> None:
        """Each distribution's ids, then ids with every bad kind: this rank's rows, and their sum."""
        kinds = [(d.name, d, False) for d in self.dists] + [
            ("with bad ids and the split's edges", None, True)
        ]
        for n in self.args.ids:
            for kind, drawn, bad in kinds:
                ids = self.ids((label, "check", n, kind), n, bad, drawn)
                for out in (RAW, BF16):
                    buf = self.buffer(n, out)
                    table.lookup(ids, out=buf)
                    self.count(ids)
                    own = self.compare(buf, ids, out, reduced=False)
                    dist.all_reduce(buf.view(torch.int8) if out == RAW else buf)
                    total = self.compare(buf, ids, out)
                    how = "bytes" if out == RAW else "values"
                    self.record(
                        f"{label}: {n} ids {kind}, all_reduce({out}) == file rows ({how})",
                        own is None and total is None,
                        "; ".join(
                            f"{what}: {why}" for what, why in (("own rows", own), ("sum", total)) if why
                        ),
                    )

    def time_eager(self, label: str, table) -> None:
        args = self.args
        for n in args.ids:
            for out in (RAW, BF16):
                buf = self.buffer(n, out, poison=False)
                us, wrong = [], []
                for k in range(args.warmup + args.repeats):
                    ids = self.ids((label, "eager", n, out, k), n, False)
                    buf.view(torch.uint8).fill_(0xAB)  # a step must write every row (untimed)
                    us.append(self.timed(lambda ids=ids, buf=buf, out=out: self.step(table, ids, buf, out)))
                    self.count(ids)
                    why = self.compare(buf, ids, out)
                    if why:
                        wrong.append(f"call {k}: {why}")
                self.keep_time(label, n, out, "eager", us)
                self.record(
                    f"{label}: eager {n} ids {out}: {len(us)} timed steps == file rows",
                    not wrong,
                    "; ".join(wrong[:3]),
                )

    def early_step(self, table, ids: torch.Tensor, buf: torch.Tensor, out: str) -> None:
        """A TP step whose lookup is issued early: forked onto ple-um's side stream at the step's
        start (``served.SideLookups``, as the engines' early lookups), the step's other work (a
        matmul) on the current stream meanwhile, joined where the rows are used (the all-reduce).
        Without CUDA the same step runs with no stream: the lookup inline, then the work."""
        side = self.side
        with side.fork(self.device) if side is not None else contextlib.nullcontext():
            table.lookup(ids, out=buf)
            if side is not None:
                side.mark("rows")
        torch.matmul(self.work[0], self.work[1], out=self.work[2])
        if side is not None:
            side.join("rows", self.device)
        dist.all_reduce(buf.view(torch.int8) if out == RAW else buf)

    def check_early(self, label: str, table) -> None:
        """Eager steps with the lookup issued early, fresh ids each (the first with bad ids)."""
        from ple_um.served import SideLookups

        self.side = SideLookups() if self.cuda else None
        self.work = [torch.ones((256, 256), device=self.device) for _ in range(3)]
        how = "on a side stream" if self.cuda else "with no stream (no CUDA device: the lookup inline)"
        for n in self.args.ids:
            for out in (RAW, BF16):
                buf, wrong = self.buffer(n, out, poison=False), []
                steps = self.args.warmup + self.args.repeats
                for k in range(steps):
                    ids = self.ids((label, "early", n, out, k), n, bad=k == 0)
                    buf.view(torch.uint8).fill_(0xAB)
                    self.early_step(table, ids, buf, out)
                    self.count(ids)
                    why = self.compare(buf, ids, out)
                    if why:
                        wrong.append(f"step {k}: {why}")
                self.record(
                    f"{label}: early lookups, eager {n} ids {out}: {steps} steps (the first with bad ids), "
                    "forked at the step's start, joined where used == file rows",
                    not wrong,
                    "; ".join([how, *wrong[:3]]),
                )

    def check_graphs(self, label: str, table, modes: list[str], early: bool = False) -> None:
        safe = self.gather(bool(table.capture_safe))
        if early:
            name = (
                f"{label}: CUDA graph of a step, its lookup issued early, replays with new ids == file rows"
            )
        else:
            name = f"{label}: CUDA graph of lookup + all_reduce, replays with new ids == file rows"
        if not self.cuda:
            self.record(name, None, "CUDA graphs need a CUDA device (dry run on the CPU)")
            return
        if not all(safe):
            unsafe = [f"rank {r} ({modes[r]})" for r, ok in enumerate(safe) if not ok]
            self.record(name, None, f"not capture-safe: {', '.join(unsafe)}")
            return
        args = self.args
        step = self.early_step if early else self.step
        what = "early, graph" if early else "graph"
        for n in args.ids:
            for out in (RAW, BF16):
                static = self.ids((label, what, n, out, -1), n, False)
                buf = self.buffer(n, out)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # warm up outside the capture (allocator, NCCL)
                    step(table, static, buf, out)
                    self.count(static)
                torch.cuda.current_stream(self.device).wait_stream(side)
                self.sync()
                dist.barrier()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step(table, static, buf, out)
                us, wrong = [], []
                for k in range(args.warmup + args.repeats + 1):
                    ids = self.ids((label, what, n, out, k), n, bad=k == 0)  # the first with bad ids
                    static.copy_(ids)
                    buf.view(torch.uint8).fill_(0xAB)  # a replay must write every row (untimed)
                    us.append(self.timed(graph.replay))
                    self.count(ids)
                    why = self.compare(buf, ids, out)
                    if why:
                        wrong.append(f"replay {k}: {why}")
                if not early:
                    self.keep_time(label, n, out, "graph", us[1:])
                self.record(
                    f"{label}: {what} {n} ids {out}: {len(us)} replays with new ids (the first with bad ids) "
                    "== file rows",
                    not wrong,
                    "; ".join(wrong[:3]),
                )
                self.sync()
                del graph

    def check_row_cache(self, label: str, stats: dict, cache: int | None) -> None:
        """The row cache's counts, kept for the report; in the row cache pass, a ``cpu`` rank's cache
        and reader of misses must both have served (hits, misses, reads of the files)."""
        found = stats["row_cache"]
        mine = {
            "mode": stats["mode"],
            "asked": cache,
            "file_reads": stats["file_reads"],
            "file_reader": stats["file_reader"],
            **({k: found[k] for k in ("hits", "misses", "evictions", "rows", "bytes")} if found else {}),
        }
        self.row_cache[label] = self.gather(mine)
        if cache is None or stats["mode"] != "cpu":
            return
        served = found is not None and found["hits"] > 0 and found["misses"] > 0 and stats["file_reads"] > 0
        self.record(
            f"{label}: the row cache and the reader of misses served (hits, misses, file reads)",
            served,
            f"{mine}",
        )

    # -- the Engram table, split by heads ----------------------------------------------------------------
    def check_engram(self) -> None:
        """An Engram-shaped table split by heads, as ``ple_um.vllm.engram`` splits it: each rank
        opens the rows of its heads (``open_engram_table``, rows = ``geometry.head_rows``) and looks
        up its heads' columns of the same hashes; the heads gathered across the ranks (all_gather)
        must equal the whole table's rows decoded from the file, bit for bit: eager, and on a GPU in
        a CUDA graph of lookup + all_gather replayed with new hashes."""
        if self.args.engram_dir is None:
            return
        files = EngramFiles(self.args.engram_dir)
        geometry = engram_geometry(files.num_rows)
        sizes = geometry.head_sizes[0]
        if len(sizes) % self.world:
            self.record(
                "engram: heads split over the ranks", None, f"{len(sizes)} heads over {self.world} ranks"
            )
            return
        per = len(sizes) // self.world
        first = self.rank * per
        rows = geometry.head_rows(ENGRAM_LAYER, first, first + per)
        self.eg = {
            "files": files,
            "geometry": geometry,
            "sizes": sizes,
            "starts": np.cumsum([0, *sizes[:-1]]),
            "heads": (first, first + per),
            "rows": rows,
            "ref": files.load(self.device),
        }
        self.engram = {
            "directory": self.args.engram_dir,
            "num_rows": files.num_rows,
            "head_dim": files.dim,
            "head_rows": list(sizes),
            "heads": [first, first + per],
            "rows": list(rows),
        }
        if not self.cuda:
            self.record(
                "engram registered: whole run",
                None,
                "registered needs a CUDA device (dry run: cpu mode only)",
            )
        everyone = [geometry.head_rows(ENGRAM_LAYER, r * per, (r + 1) * per) for r in range(self.world)]
        spans = [(hi - lo) * ENGRAM_ROW_BYTES for lo, hi in everyone]
        self.knobs(None)  # prewarmed at open, the row cache as the environment set it
        for mode in ("registered", "cpu") if self.cuda else ("cpu",):
            refused = self.pins_refused([mode] * self.world, spans)
            if refused:
                self.record(f"engram {mode}: whole run", None, refused)
                continue
            self.engram_mode(mode)

    def engram_mode(self, mode: str) -> None:
        import ple_um

        eg, label = self.eg, f"engram {mode}"
        self.sync()
        dist.barrier()
        if self.rank == 0:
            evict_pages([eg["files"].path])
        dist.barrier()
        before = (process_memory(), system_memory(None))
        table, error = None, None
        try:
            table = ple_um.open_engram_table(
                self.args.engram_dir,
                layer=ENGRAM_LAYER,
                rows=eg["rows"],
                geometry=eg["geometry"],
                mode=mode,
                device=self.device,
            )
        except Exception as exc:  # noqa: BLE001 - reported as a failed check; the other ranks go on
            error = f"{type(exc).__name__}: {exc}"
        self.sync()
        dist.barrier()
        after = (process_memory(), system_memory(None))
        errors = self.gather(error)
        got = None if table is None else (table.mode, tuple(table.rows))
        self.record(
            f"{label}: open heads {list(eg['heads'])} = rows {list(eg['rows'])} mode={mode}",
            error is None and got == (mode, eg["rows"]),
            error or f"mode {got[0]}, rows {list(got[1])}, capture_safe={table.capture_safe}",
        )
        if any(e is not None for e in errors):
            if table is not None:
                table.close()
            return
        try:
            stats = table.stats()
            mine = {
                "mode": table.mode,
                "pinned_bytes": stats["pinned_bytes"],
                "owned_bytes": (eg["rows"][1] - eg["rows"][0]) * ENGRAM_ROW_BYTES,
                "mapped_bytes": stats["mapped_bytes"],
                "before": before[0],
                "after": after[0],
                "growth": {k: after[0].get(k, 0) - before[0].get(k, 0) for k in after[0]},
            }
            system = {"before": before[1], "after": after[1]}
            system["growth"] = {k: after[1].get(k, 0) - before[1].get(k, 0) for k in after[1]}
            table_bytes = eg["files"].num_rows * ENGRAM_ROW_BYTES
            self.memory[label] = {"ranks": self.gather(mine), "system": system, "table_bytes": table_bytes}
            self.engram_lookups(label, table)
        finally:
            table.close()

    def engram_hashes(self, key: tuple, tokens: int) -> torch.Tensor:
        """[tokens, heads] global row ids, the same on every rank: each head's column uniform in its
        own range, the range's ends in the first and the last token."""
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        sizes = np.array(self.eg["sizes"])
        cols = rng.integers(0, sizes, (tokens, len(sizes)))
        cols[0], cols[-1] = 0, sizes - 1
        return torch.from_numpy(cols + self.eg["starts"]).to(self.device)

    def engram_compare(self, parts: torch.Tensor, hashes: torch.Tensor, own: bool) -> str | None:
        """None when ``parts`` (this rank's heads [T, per, D], or all ranks' gathered
        [world * T, per, D] when not ``own``) are the file's rows bit for bit, else what differs."""
        values, exponents = self.eg["ref"]
        want = EngramFiles.decode(values[hashes], exponents[hashes])
        tokens, per = hashes.shape[0], parts.shape[1]
        if own:
            first = self.eg["heads"][0]
            want = want[:, first : first + per]
        else:  # rank-major [world, T, per, D] -> [T, world * per, D]
            parts = parts.unflatten(0, (self.world, tokens)).transpose(0, 1).reshape(want.shape)
        differ = (parts.view(torch.int16) != want.view(torch.int16)).any(dim=-1)
        return (
            f"{int(differ.sum())} of {differ.numel()} head rows differ in their bits"
            if differ.any()
            else None
        )

    def engram_step(self, table, hashes: torch.Tensor, part: torch.Tensor, gathered: torch.Tensor) -> None:
        """This rank's heads' rows of ``hashes``, then every rank's gathered into ``gathered``."""
        first, end = self.eg["heads"]
        table.lookup(hashes[:, first:end], out=part)
        all_gather(gathered, part)

    def engram_lookups(self, label: str, table) -> None:
        heads = len(self.eg["sizes"])
        per = heads // self.world
        dim = self.eg["files"].dim
        for n in self.args.ids:
            tokens = max(2, n // heads)
            part = torch.empty((tokens, per, dim), dtype=torch.bfloat16, device=self.device)
            gathered = torch.empty((self.world * tokens, per, dim), dtype=torch.bfloat16, device=self.device)
            hashes = self.engram_hashes((label, "check", n), tokens)
            part.fill_(float("nan"))
            gathered.fill_(float("nan"))
            self.engram_step(table, hashes, part, gathered)
            own = self.engram_compare(part, hashes, own=True)
            total = self.engram_compare(gathered, hashes, own=False)
            self.record(
                f"{label}: {tokens} tokens x {heads} heads, all_gather(bf16) == file rows (bits)",
                own is None and total is None,
                "; ".join(f"{what}: {why}" for what, why in (("own heads", own), ("gathered", total)) if why),
            )
            self.engram_graph(label, table, tokens, part, gathered)

    def engram_graph(
        self, label: str, table, tokens: int, part: torch.Tensor, gathered: torch.Tensor
    ) -> None:
        name = f"{label}: CUDA graph of lookup + all_gather, {tokens} tokens, new hashes == file rows"
        safe = self.gather(bool(table.capture_safe))
        if not self.cuda:
            self.record(name, None, "CUDA graphs need a CUDA device (dry run on the CPU)")
            return
        if not all(safe):
            self.record(name, None, f"not capture-safe on ranks {[r for r, ok in enumerate(safe) if not ok]}")
            return
        static = self.engram_hashes((label, "graph", tokens, -1), tokens)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up outside the capture (allocator, NCCL)
            self.engram_step(table, static, part, gathered)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.engram_step(table, static, part, gathered)
        wrong = []
        replays = self.args.warmup + self.args.repeats
        for k in range(replays):
            static.copy_(self.engram_hashes((label, "graph", tokens, k), tokens))
            gathered.fill_(float("nan"))
            graph.replay()
            why = self.engram_compare(gathered, static, own=False)
            if why:
                wrong.append(f"replay {k}: {why}")
        self.record(name, not wrong, f"{replays} replays; " + "; ".join(wrong[:3]))
        self.sync()
        del graph

    def anchor(self) -> None:
        """One device holding the whole table: torch.index_select on the resident copy (then the
        dequantization for bf16), rank 0 alone, no all-reduce; eager and replayed."""
        self.sync()
        dist.barrier()
        if self.rank == 0:
            label = f"one {'GPU' if self.cuda else 'process'}, whole table, no all-reduce"
            calls = range(self.args.warmup + self.args.repeats)
            for n in self.args.ids:
                for out in (RAW, BF16):
                    buf = self.buffer(n, out, poison=False)

                    def select(ids, buf=buf, out=out):
                        rows = self.ref.index_select(0, ids)
                        buf.view(torch.uint8).copy_(rows) if out == RAW else buf.copy_(self.dequant(rows))

                    batches = [self.ids(("anchor", n, k), n, False) for k in calls]
                    us = [self.timed(lambda ids=ids: select(ids), together=False) for ids in batches]
                    self.keep_time(label, n, out, "eager", us)
                    if not self.cuda:
                        continue
                    static = batches[0].clone()
                    select(static)  # kernels loaded outside the capture
                    self.sync()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        select(static)
                    us = []
                    for ids in batches:
                        static.copy_(ids)
                        us.append(self.timed(graph.replay, together=False))
                    self.keep_time(label, n, out, "graph", us)
                    self.sync()
                    del graph
        dist.barrier()


# -- reporting ---------------------------------------------------------------------------------------
def _per_rank(mem: dict, key: str, growth: bool = True) -> str:
    return " / ".join(gib(r["growth"].get(key, 0) if growth else r[key]) for r in mem["ranks"])


def memory_table(memory: dict) -> list[str]:
    lines = [
        "memory, per rank (r0 / r1 ...) and of the host, from before any rank opened to after all had:",
        "",
        "| modes (rank 0/1) | pinned | RssAnon growth | RssFile growth | table pages cached growth "
        "| host page cache growth | MemAvailable change |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, mem in memory.items():
        growth = mem["system"]["growth"]
        table, cached = growth.get("TableCached"), growth.get("Cached", 0)
        table_cell = "-" if table is None else f"{gib(table)} ({table / mem['table_bytes']:.2f} tables)"
        lines.append(
            f"| {label} | {_per_rank(mem, 'pinned_bytes', False)} | {_per_rank(mem, 'RssAnon')} | "
            f"{_per_rank(mem, 'RssFile')} | {table_cell} | "
            f"{gib(cached)} ({cached / mem['table_bytes']:.2f} tables) | "
            f"{gib(mem['system']['growth'].get('MemAvailable', 0))} |"
        )
    return lines


def row_cache_table(row_cache: dict) -> list[str]:
    lines = [
        "row cache per rank, from the table's open to its close (none: the host path kept none):",
        "",
        "| modes (rank 0/1) | rank | mode | row cache | hits | misses | hit rate | reads of misses |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, ranks in row_cache.items():
        for r, c in enumerate(ranks):
            if "hits" not in c:
                lines.append(f"| {label} | {r} | {c['mode']} | none | - | - | - | {c['file_reads']} |")
                continue
            asked = c["hits"] + c["misses"]
            rate = f"{c['hits'] / asked:.3f}" if asked else "-"
            lines.append(
                f"| {label} | {r} | {c['mode']} | {gib(c['bytes'])} | {c['hits']} | {c['misses']} | {rate} | "
                f"{c['file_reads']} ({c['file_reader']}) |"
            )
    return lines


def timing_table(timings: list[dict], repeats: int) -> list[str]:
    lines = [
        f"time per step on rank 0, us: median [p10, p90] of {repeats} steps, fresh ids each",
        "",
        "| modes (rank 0/1) | ids | rows summed as | eager | CUDA graph replay |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows: dict[tuple, dict] = {}
    for t in timings:
        rows.setdefault((t["modes"], t["ids"], t["out"]), {})[t["how"]] = t
    for (label, n, out), hows in rows.items():
        cells = [
            f"{h['median_us']:.1f} [{h['p10_us']:.1f}, {h['p90_us']:.1f}]" if h else "-"
            for h in (hows.get("eager"), hows.get("graph"))
        ]
        lines.append(f"| {label} | {n} | {out} | {cells[0]} | {cells[1]} |")
    return lines


def report(results: list[dict], args, directory: str, written: dict, started: float) -> dict:
    """Print the failures, the skip reasons, the tally, the memory table and the timing table
    (rank 0's times; every rank's are in the JSON) and return the JSON."""
    checks = [c for r in results for c in r["checks"]]
    counts = {s: sum(c["status"] == s for c in checks) for s in ("PASS", "FAIL", "SKIP")}
    first = results[0]
    lines = [f"FAIL rank {c['rank']}: {c['name']} -- {c['detail']}" for c in checks if c["status"] == "FAIL"]
    lines += [f"skipped: {why}" for why in sorted({c["detail"] for c in checks if c["status"] == "SKIP"})]
    lines += [f"tp_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", ""]
    for r in results:
        if r["memory_limit"] is not None:
            peak = r["memory_limit"]["peak_bytes"]
            held = f", its group's peak {gib(peak)}" if peak is not None else ""
            lines.append(f"memory limit of rank {r['rank']}: {r['memory_limit']['how']}{held}")
    lines += row_cache_table(first["row_cache"]) + [""] + memory_table(first["memory"])
    lines += [""] + timing_table(first["timings"], args.repeats)
    print("\n".join(lines), flush=True)
    files = FileTable(directory)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "world": args.world,
        "backend": args.backend,
        "torch": torch.__version__,
        "torch_threads_per_rank": torch.get_num_threads(),
        "environment": {k: os.environ.get(k) for k in NO_MULTICAST},
        "table": {
            "directory": directory,
            "written": written,
            "num_rows": files.num_rows,
            "row_bytes": files.row_bytes,
            "shards": files.parts,
            "bytes": files.nbytes,
            "ranges": [r["range"] for r in results],
        },
        "seed": first["seed"],
        "pin_budget": first["pin_budget"],
        "seconds": time.perf_counter() - started,
        "passed": counts["FAIL"] == 0 and counts["PASS"] > 0,
        "counts": counts,
        "checks": checks,
        "memory": first["memory"],
        "tables": [r["tables"] for r in results],
        "distributions": {d.name: d.describe() for d in id_distributions(args.distributions)},
        "row_cache": first["row_cache"],
        "memory_limit": [r["memory_limit"] for r in results],
        "early_lookups": {
            "streams": args.device == "cuda",
            "how": "forked onto ple-um's side stream (served.SideLookups) at the step's start, joined "
            "before the all-reduce; eager and in a CUDA graph"
            if args.device == "cuda"
            else "no CUDA device: the same step with no stream, the lookup inline; eager only",
        },
        "engram": [r["engram"] for r in results],
        "timings": [t for r in results for t in r["timings"]],
    }


# -- processes -------------------------------------------------------------------------------------------
def start_watchdog(seconds: float, who: str) -> None:
    """End this process with 124 once ``seconds`` have passed, whatever it waits for."""

    def fire() -> None:
        log(who, "watchdog: the run's time limit (--timeout) has passed; exiting with 124")
        os._exit(124)

    timer = threading.Timer(max(seconds, 1.0), fire)
    timer.daemon = True
    timer.start()


def leave(rc: int, timeout: float, who: str) -> None:
    """End this rank with ``rc``: the process group's teardown in a thread with its own time limit
    (the teardown of spawned NCCL ranks can hang after their work is done), then os._exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
        teardown.start()
        teardown.join(timeout)
        if teardown.is_alive():
            log(who, f"process group teardown still running after {timeout:.0f} s; exiting with {rc} anyway")
    sys.stdout.flush()
    os._exit(rc)


def join_memory_group(group: dict | None) -> str | None:
    """Move this process into the memory cgroup the launcher made for it: what it maps, reads and
    allocates from now on is charged there (the interpreter and torch, imported before, are not).
    None once it is in, or where there is no group; else why it could not join."""
    if group is None or not group["enforced"]:
        return None
    try:
        with open(os.path.join(group["group"], "cgroup.procs"), "w") as f:
            f.write("0")  # "0": the writing process
    except OSError as exc:
        return f"cannot join {group['group']}: {exc.strerror or exc}"
    return None


def run_rank(
    rank: int, world: int, local_rank: int, args, directory: str, written: dict, limit: float
) -> None:
    """One rank, start to end, within ``limit`` seconds; never returns (see leave)."""
    os.environ.update(NO_MULTICAST)
    who = f"r{rank}"
    start_watchdog(limit, who)
    started = time.perf_counter()
    # tqdm's default lock is a multiprocessing semaphore, which os._exit would leave to the resource
    # tracker (a warning at exit); ple_um's progress bars run in this process's threads only.
    tqdm.set_lock(threading.RLock())
    # The host's cores shared out (as torchrun's OMP_NUM_THREADS=1 would, less strictly): ranks that
    # each spin a thread per core slow each other's host work down many times over.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    rc = 2
    try:
        joined = join_memory_group(args.memory_groups[rank])
        device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
        extra = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            extra["device_id"] = device
        timeout = datetime.timedelta(seconds=max(limit, 1.0))
        dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=timeout, **extra)
        results = [None] * world
        dist.all_gather_object(results, Rank(rank, world, args, device, directory, joined).run())
        rc = 0 if all(c["status"] != "FAIL" for r in results for c in r["checks"]) else 1
        if rank == 0:
            summary = report(results, args, directory, written, started)
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(summary, f, indent=1)
                log(who, f"wrote {args.out}")
    except Exception:  # noqa: BLE001 - any error ends the rank with 2, its traceback printed
        traceback.print_exc()
        rc = 2
    leave(rc, args.teardown_timeout, who)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(args) -> int:
    """Launcher: write or reuse the tables, make each rank's memory cgroup (--memory-limit), start
    one process per rank, wait for them within the run's time limit; a rank that fails ends the
    others after a grace period (they would wait in a collective for it). The groups are removed
    once the ranks have exited."""
    deadline = time.monotonic() + args.timeout
    start_watchdog(args.timeout + args.teardown_timeout + 30, "launcher")  # last resort
    directory, written = prepare_table(args, "launcher")
    args.engram_dir = prepare_engram(args, "launcher")
    with contextlib.ExitStack() as held:
        if args.memory_limit is not None:
            from ple_um.bench.memlimit import MemoryLimit

            for r in range(args.world):
                limit = MemoryLimit.open(args.memory_limit, f"tp_check-r{r}-{os.getpid()}")
                held.callback(remove_group, limit)
                args.memory_groups[r] = {
                    "limit": limit.limit,
                    "group": limit.group,
                    "enforced": limit.enforced,
                    "how": limit.describe(),
                }
                log("launcher", f"rank {r}'s memory limit: {limit.describe()}")
        return _spawn(args, directory, written, deadline)


def remove_group(limit) -> None:
    """Remove a rank's memory cgroup once the rank has exited; where the kernel still refuses, say
    so (the run's result stands)."""
    try:
        limit.close()
    except OSError as exc:
        log("launcher", str(exc))


def _spawn(args, directory: str, written: dict, deadline: float) -> int:
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ctx = mp.get_context("spawn")
    limit = deadline - time.monotonic() - 5  # the ranks' watchdogs fire before the launcher's deadline
    procs = [
        ctx.Process(target=run_rank, args=(r, args.world, r, args, directory, written, limit), daemon=True)
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    failed_at = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        for p in procs:
            p.join(0.2)
        if failed_at is None and any(p.exitcode not in (None, 0, 1) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > args.teardown_timeout:
            break
    for p in procs:
        if p.is_alive():
            log(
                "launcher",
                f"ending rank {procs.index(p)} (pid {p.pid}): the run is over or another rank failed",
            )
            p.kill()
            p.join(10)
    codes = [p.exitcode for p in procs]
    log("launcher", f"rank exit codes {codes}")
    if all(c == 0 for c in codes):
        return 0
    if time.monotonic() >= deadline:
        return 124
    return next((c for c in codes if c is not None and c > 0), 2)


def torchrun() -> bool:
    """Whether torchrun started this process (as one of the ranks)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--size", type=units.parse_size, default=16 << 30, help="table bytes (16GiB, 8GiB, 32MiB)")
    p.add_argument("--row-bytes", type=int, default=160, help="FP8 row width (Qwen3.8-Flash-Next: 160)")
    p.add_argument("--shards", type=int, default=128, help="shards of the table (4 files)")
    p.add_argument(
        "--dir", help="table directory (default: PLE_UM_CACHE_DIR/tp_check-fp8-<rows>x<width>-<shards>)"
    )
    p.add_argument("--world", type=int, default=2, help="ranks to spawn (torchrun: its WORLD_SIZE)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if cuda else "gloo")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    p.add_argument("--ids", type=lambda t: [int(x) for x in t.split(",")], default=[1024, 131072])
    p.add_argument(
        "--distributions",
        default="uniform,zipf:1.1,trace",
        help="the bench's id distributions every check draws from (ple_um.bench.ids)",
    )
    p.add_argument(
        "--row-cache",
        type=units.parse_size,
        help="a second pass of every mode set with PLE_UM_ROW_CACHE of this size per rank (8MiB, 2GiB): "
        "no prewarm, pages dropped first, misses read by the reader into the row cache",
    )
    p.add_argument(
        "--memory-limit",
        type=units.parse_size,
        help="each rank in a memory cgroup of its own of this size (page cache included, no swap); "
        "where none can be made, the run says why and goes on without",
    )
    p.add_argument(
        "--engram-size",
        type=units.parse_size,
        help="bytes of the DeepSeek-V4.1 Engram table split by heads over the ranks (default: 1GiB on "
        "CUDA, 4MiB on the CPU; 0: none)",
    )
    p.add_argument("--repeats", type=int, default=20, help="timed steps per case (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per case (their outputs are checked)")
    p.add_argument("--seed", type=int, help="ids seed (default: from the clock; in the JSON)")
    p.add_argument("--timeout", type=float, default=450.0, help="seconds for the whole run (watchdog)")
    p.add_argument(
        "--teardown-timeout", type=float, default=30.0, help="seconds for the process group teardown"
    )
    p.add_argument(
        "--write-workers", type=int, default=min(16, os.cpu_count() or 1), help="threads writing the table"
    )
    default_out = os.path.join(os.environ["OUT"], "tp_check.json") if os.environ.get("OUT") else None
    p.add_argument(
        "--out", default=default_out, help="JSON path (default: $OUT/tp_check.json when OUT is set)"
    )
    args = p.parse_args(argv)
    if torchrun():
        args.world = int(os.environ["WORLD_SIZE"])
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    if args.device == "cuda" and (not cuda or torch.cuda.device_count() < args.world):
        p.error(f"--device cuda needs {args.world} CUDA devices; this host has {torch.cuda.device_count()}")
    if min(args.repeats, args.world, *args.ids) < 1 or args.warmup < 0:
        p.error("--repeats, --world and --ids must be at least 1, --warmup at least 0")
    if args.engram_size is None:
        args.engram_size = 1 << 30 if args.device == "cuda" else 4 << 20
    try:
        table_shape(args.size, args.row_bytes, args.shards, args.world)
        id_distributions(args.distributions)
        if args.engram_size:
            engram_geometry(engram_rows(args.engram_size))
    except ValueError as exc:
        p.error(str(exc))
    if args.memory_limit is not None and torchrun():
        p.error("--memory-limit needs this script's own launcher (it makes each rank's group), not torchrun")
    args.memory_groups = [None] * args.world  # the launcher's: each rank's memory cgroup
    return args


def main() -> None:
    args = parse_args()
    os.environ.update(NO_MULTICAST)
    if torchrun():  # this process is a rank
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        t0 = time.monotonic()
        start_watchdog(args.timeout, f"r{rank}")  # the table's writing included
        directory, written = prepare_table(args, f"r{rank}")
        args.engram_dir = prepare_engram(args, f"r{rank}")
        run_rank(
            rank, args.world, local_rank, args, directory, written, args.timeout - (time.monotonic() - t0)
        )
    sys.exit(spawn_ranks(args))


if __name__ == "__main__":
    main()
