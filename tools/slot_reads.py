"""Row cache hits served two ways, measured in one run (issue #43, "What to build" 1):

(a) the ``cpu`` mode's lookup, the product path: the C row copy copies each hit from the row cache
    into pinned staging, then one host-to-device copy; eager (synchronised) and, on CUDA, replayed
    from a CUDA graph;
(b) the best case of the kernel reading hits straight from the row cache's slots: the ids copied to
    the host, the C find of their slots (``ple_cache_find``: read-only, nothing counted), the slots
    copied to the device, then ple-um's gather kernel (through ``GpuGather``, launched directly)
    reading each row at slots_base + slot * row_bytes from the cache's memory registered with CUDA
    (as the registered mode registers its mappings); eager, synchronised. No protection of a slot
    against its rewrite between the find and the kernel's read (a design would need one).

The steady state where every row looked up is a hit: ``--hot`` random rows read into a row cache of
``--cache`` bytes, the rows it holds then drawn afresh for each call, 1 024 and 16 ids. (b) asserts
that every id is found. Each path gets fresh ids of its own, the paths taking turns at going first.
Every output is poisoned first; (b)'s must equal, byte for byte, the cpu mode's lookup of the same
ids (untimed), and every path's output of the first ``--checks`` calls the rows read from the files.

    python3 tools/slot_reads.py --dir TABLE --json-file $OUT/slot_reads.json

Without CUDA (``--device cpu``) the kernel runs under the Triton interpreter on the cache's host
addresses: for exactness only, its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: the CPU's kernel

from host_cost import quantiles  # noqa: E402
from profile_cold import Lookup, with_knobs  # noqa: E402

import ple_um  # noqa: E402
from ple_um import units  # noqa: E402
from ple_um.access import machine  # noqa: E402
from ple_um.lookup.gpu_gather import GpuGather  # noqa: E402
from ple_um.lookup.host.gather import warm_row_cache  # noqa: E402
from ple_um.verify import read_file_rows  # noqa: E402

SIZES = (1024, 16)
POISON = 0xA5


def find_slots(host, ids: np.ndarray) -> np.ndarray:
    """Each id's slot in ``host``'s row cache, or -1 (the C find)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    slots = np.empty_like(ids)
    host.lib.ple_cache_find(host.rows.cache.address, ids.ctypes.data, ids.size, slots.ctypes.data)
    return slots


@contextlib.contextmanager
def slots_base(cache, device: torch.device):
    """The address the device reads the cache's slot 0 at: its memory registered with CUDA for the
    body (as the registered mode registers its mappings), or on a CPU its host address."""
    if device.type != "cuda":
        yield cache.struct.data
        return
    calls = machine.registration()
    calls.register(cache._base, cache.nbytes)
    try:
        yield calls.device_pointer(cache._base) + (cache.struct.data - cache._base)
    finally:
        torch.cuda.synchronize()
        calls.unregister(cache._base)


class SlotReads:
    """Design (b) over ``table``'s row cache (a ``cpu``-mode table with one), whose slot 0 the
    device reads at ``base``: the gather kernel reads the slots as one shard of ``slots`` rows."""

    def __init__(self, table, base: int, n: int) -> None:
        host = table.paths.row_copy
        self.cache, self.lib, self.n = host.rows.cache, host.lib, n
        self.device, cuda = table.device, table.device.type == "cuda"
        slots = self.cache.slots
        # The slots as a table of one shard: row k lies at base + k * row_bytes (64-byte aligned).
        layout = dataclasses.replace(table.mapping.layout, num_rows=slots, rows_per_shard=slots)
        self.gather = GpuGather(
            layout, [base], device=self.device, row_start=0, row_end=slots, base_align=64, scale=None
        )
        self.ids_host = torch.empty(n, dtype=torch.int64, pin_memory=cuda)
        self.slots_host = torch.empty(n, dtype=torch.int64, pin_memory=cuda)
        self.slots = torch.empty(n, dtype=torch.int64, device=self.device)
        self.out = torch.empty((n, table.row_dim), dtype=table.dtype, device=self.device)
        # The find's arguments, taken once: its time is the C call's, not Python's.
        self.find_args = (self.cache.address, self.ids_host.data_ptr(), n, self.slots_host.data_ptr())

    def time(self, ids: torch.Tensor) -> tuple[float, float, float, float]:
        """One lookup of ``ids`` (on the device) into ``out``: its seconds, and of them the ids'
        copy to the host, the find, and the slots' copy and the kernel (each until it is done)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        self.ids_host.copy_(ids)  # a synchronous copy: the host reads them next
        t1 = time.perf_counter()
        found = self.lib.ple_cache_find(*self.find_args)
        t2 = time.perf_counter()
        self.slots.copy_(self.slots_host, non_blocking=True)
        self.gather.gather(self.slots, self.out)
        sync()
        t3 = time.perf_counter()
        assert found == self.n, f"{self.n - found} of {self.n} ids missed the row cache: (b) is invalid"
        return t3 - t0, t1 - t0, t2 - t1, t3 - t2


def poison(*outs: torch.Tensor) -> None:
    for out in outs:
        out.view(torch.uint8).fill_(POISON)


def measure(table, base: int, held: np.ndarray, n: int, calls: int, checks: int, warmup: int, rng) -> dict:
    cuda = table.device.type == "cuda"
    lookups = {"a_eager": Lookup(table, n, False, table.dtype)}
    if cuda:
        lookups["a_graph"] = Lookup(table, n, True, table.dtype)
    slot_reads = SlotReads(table, base, n)
    ids = torch.empty(n, dtype=torch.int64, device=table.device)
    times = {name: [] for name in (*lookups, "b_eager", "b_ids_to_host", "b_find", "b_slots_and_kernel")}
    before = table.stats()["row_cache"]
    check = torch.empty_like(slot_reads.out)
    order = [*lookups, "b_eager"]
    for k in range(warmup + calls):
        # Fresh ids for each path, the paths in turn first: no path finds another's rows in the
        # CPU's caches.
        took, outs = {}, {}
        for name in order[k % len(order) :] + order[: k % len(order)]:
            draw = rng.choice(held, n)
            if name == "b_eager":
                ids.copy_(torch.from_numpy(draw))
                poison(slot_reads.out)
                parts = slot_reads.time(ids)
                took.update(
                    zip(("b_eager", "b_ids_to_host", "b_find", "b_slots_and_kernel"), parts, strict=True)
                )
                outs[name] = (draw, slot_reads.out)
                poison(check)  # (a) on (b)'s ids, untimed: (b) must equal it byte for byte
                table.lookup(ids, out=check)
                assert torch.equal(slot_reads.out.view(torch.uint8), check.view(torch.uint8)), (
                    f"(b) != (a), {n} ids"
                )
            else:
                poison(lookups[name].out)
                took[name] = lookups[name].time(draw)
                outs[name] = (draw, lookups[name].out)
        if k < checks:
            for name, (draw, out) in outs.items():
                expected = read_file_rows(table.mapping.layout, draw)
                assert np.array_equal(out.view(torch.uint8).cpu().numpy(), expected), (
                    f"{name} != the files' rows"
                )
        if k >= warmup:
            for name, seconds in took.items():
                times[name].append(seconds)
    after = table.stats()["row_cache"]
    found = {name: quantiles(seconds) for name, seconds in times.items()}
    for name in lookups:
        found[f"ratio_b_eager_to_{name}"] = found["b_eager"]["median_us"] / found[name]["median_us"]
    found["a_misses"] = after["misses"] - before["misses"]  # 0: every row of (a) was a hit
    found["checked_calls"] = warmup + calls
    found["checked_against_files"] = min(checks, warmup + calls)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the table's checkpoint directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cache", default="1GiB", help="the row cache's bytes (PLE_UM_ROW_CACHE)")
    for name, default, what in (
        ("hot", 500_000, "hot rows read into the row cache"),
        ("calls", 300, "timed calls per size"),
        ("warmup", 30, "untimed calls per size, before them"),
        ("checks", 5, "calls per size checked against the files"),
        ("seed", 0, "of the hot rows and the ids drawn"),
    ):
        p.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--json-file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs the kernel under the Triton interpreter: set TRITON_INTERPRET=1")
    rng = np.random.default_rng(args.seed)
    with_knobs({"PLE_UM_ROW_CACHE": str(units.parse_size(args.cache))})
    with ple_um.open_table(args.dir, mode="cpu", device=device) as table:
        host = table.paths.row_copy
        assert host is not None and host.rows.cache is not None, f"no row cache: {table.row_reads}"
        hot = rng.choice(table.num_rows, size=min(args.hot, table.num_rows), replace=False)
        t0 = time.perf_counter()
        for _ in range(2):  # a row missed twice is kept by every policy where its set has room
            warm_row_cache(host, hot)
        warm_s = time.perf_counter() - t0
        result = {
            "device": str(device),
            "table": {"dir": args.dir, "rows": table.num_rows, "row_bytes": table.mapping.layout.row_bytes},
            "row_reads": table.row_reads,
            "warm_s": warm_s,
        }
        held = hot[find_slots(host, hot) >= 0]
        result.update(hot_rows=int(hot.size), held_rows=int(held.size), row_cache=table.stats()["row_cache"])
        assert held.size, "the row cache holds none of the hot rows"
        with slots_base(host.rows.cache, device) as base:
            result["sizes"] = {
                str(n): measure(table, base, held, n, args.calls, args.checks, args.warmup, rng)
                for n in SIZES
            }
    report(result)
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def report(result: dict) -> None:
    cache = result["row_cache"]
    print(
        f"device {result['device']}, {result['table']['rows']} rows of {result['table']['row_bytes']} B; "
        f"a row cache of {units.format_bytes(cache['bytes'])} holding {result['held_rows']} of "
        f"{result['hot_rows']} hot rows (warmed in {result['warm_s']:.1f} s)"
    )
    print("| ids | path | median us [p10-p90] | (b) / this |\n| --- | --- | --- | --- |")
    names = {
        "a_eager": "(a) cpu mode, eager",
        "a_graph": "(a) cpu mode, graph replay",
        "b_eager": "(b) slot reads, eager",
        "b_ids_to_host": "  (b) ids to the host",
        "b_find": "  (b) C find of the slots",
        "b_slots_and_kernel": "  (b) slots to the device + kernel",
    }
    for n, found in result["sizes"].items():
        for key, name in names.items():
            if key in found:
                q, ratio = found[key], found.get(f"ratio_b_eager_to_{key}")
                shown = f"{ratio:.2f}" if ratio is not None else ""
                print(
                    f"| {n} | {name} | {q['median_us']:.1f} [{q['p10_us']:.1f}-{q['p90_us']:.1f}] | {shown} |"
                )
        print(
            f"| {n} | checks | (b) = (a) in all {found['checked_calls']} calls, = the files' rows in "
            f"{found['checked_against_files']}; (a) missed {found['a_misses']} rows | |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
