"""The benchmark: every lookup path this machine can run, on one table, in one run.

Every contender is open at once and measured side by side: each timed round times a block of
every contender's calls, each block after its own warm-up, in an order rotated from round to
round, so drift in the host's speed over the run (other tenants, clocks, background work) falls on
all of them alike instead of on whichever ran at a bad moment. Fresh ids for every timed call
(drawn ahead, uniform or Zipf-hashed: ``bench/ids.py``), CUDA events on a GPU (perf_counter on the
CPU), medians with p10/p90, GB/s of useful rows, and every median's ratio to the anchor: plain
``torch.index_select`` over the table resident in GPU memory. Beside the medians, the host's cost
of an eager call: wall time per call of back-to-back 16-row calls with one sync at the end. Then a
decode step, eager and graph-replayed, and start-up and memory figures.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

import ple_um
from ple_um import envs
from ple_um.bench.contenders import SeedsCpuPath, TorchResident, VllmPinnedHost
from ple_um.bench.ids import IdDistribution, parse_ids
from ple_um.checkpoint import ShardLayout, read_layout
from ple_um.synthetic import write_checkpoint

DEFAULT_ROWS = (16, 1024, 16384, 131072)
# The anchor every path's times are divided by: no ple-um code at all (contenders.TorchResident).
ANCHOR = "torch index_select"
# The host-overhead figure: this many back-to-back eager calls of this many rows.
HOST_CALLS, HOST_ROWS = 300, 16
# Warm-up at the start of every block of timed calls: at least this long (and `warmup` calls).
SETTLE_S = 0.005


@dataclass
class Config:
    directory: str | None = None
    size: int = 2 << 30
    row_bytes: int = 160
    shards: int = 128
    rows: tuple[int, ...] = DEFAULT_ROWS
    modes: tuple[str, ...] | None = None
    ids: tuple[IdDistribution, ...] = parse_ids("uniform")
    repeats: int = 20
    warmup: int = 3
    rounds: int = 4
    decode_tokens: int = 64
    heads: int = 16
    device: str | None = None
    processes: int = 0
    seed: int = 0
    host_calls: int = HOST_CALLS
    results: dict = field(default_factory=dict)


def default_table(cfg: Config, progress: bool = True) -> str:
    """The synthetic FP8 table shaped like Qwen3.8-Flash-Next's, written once into the cache dir."""
    num_rows = cfg.size // cfg.row_bytes
    path = os.path.join(envs.PLE_UM_CACHE_DIR, f"bench-fp8-{num_rows}x{cfg.row_bytes}-{cfg.shards}")
    marker = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(marker):
        tmp = path + ".partial"
        write_checkpoint(
            tmp,
            num_rows=num_rows,
            row_dim=cfg.row_bytes,
            dtype="F8_E4M3",
            shards=cfg.shards,
            progress=progress,
            # Written back to disk now, not while the first timings run (writeback takes CPU and
            # memory bandwidth from the lookups measured): the table's files, not the whole machine's.
            write_back=True,
        )
        if os.path.exists(path):
            import shutil

            shutil.rmtree(path)
        os.rename(tmp, path)
    return path


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def once(self, fn: Callable[[int], object], k: int) -> float:
        """Seconds of one call fn(k), from an idle device to its work done."""
        if self.cuda:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(k)
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3
        t0 = time.perf_counter()
        fn(k)
        return time.perf_counter() - t0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def back_to_back(
        self, fns: dict[str, Callable[[int], object]], calls: int, rounds: int
    ) -> dict[str, list[float]]:
        """Wall seconds per call of ``calls`` back-to-back calls with no synchronisation between
        them and one at the end: what an eager caller pays per call, the host's launch work where
        the host is the slower side (the device's time where the device is). Once per round for
        each contender, in side_by_side's rotated order, each burst after a few warm calls. Every
        timed call has ids of its own: round r calls fn(r * calls + i); the warm calls reuse
        fn(rounds * calls + j), j < 10. So fn takes ``back_to_back_sets(calls, rounds)`` id sets."""
        names = list(fns)
        per_call: dict[str, list[float]] = {name: [] for name in names}
        rounds = max(1, rounds)
        for r in range(rounds):
            first = r % len(names)
            for name in names[first:] + names[:first]:
                fn = fns[name]
                for j in range(min(calls, 10)):
                    fn(rounds * calls + j)
                self.sync()
                t0 = time.perf_counter()
                for k in range(r * calls, (r + 1) * calls):
                    fn(k)
                self.sync()
                per_call[name].append((time.perf_counter() - t0) / calls)
        return per_call

    @staticmethod
    def back_to_back_sets(calls: int, rounds: int) -> int:
        """How many id sets ``back_to_back`` uses: one per timed call, and the warm calls'."""
        return max(1, rounds) * calls + min(calls, 10)

    def side_by_side(
        self, fns: dict[str, Callable[[int], object]], calls: int, warmup: int, rounds: int
    ) -> dict[str, list[float]]:
        """Seconds of ``calls`` timed calls fn(k) of each contender (k >= warmup: fresh ids), in
        ``rounds`` rounds: round r times a block of every contender's calls, contender after
        contender in an order rotated by r. Each block starts warm: ``warmup`` untimed calls
        (k < warmup, reused) and more until SETTLE_S has passed, so that the device and the host
        are back at speed after the other contenders' work (a GPU left idle through a long host
        gather answers its next launches slowly)."""
        names = list(fns)
        times: dict[str, list[float]] = {name: [] for name in names}
        rounds = max(1, min(rounds, calls))
        warm, k = max(warmup, 1), warmup
        for r in range(rounds):
            block = calls // rounds + (r < calls % rounds)
            first = r % len(names)
            for name in names[first:] + names[:first]:
                fn = fns[name]
                t0 = time.perf_counter()
                for w in range(100 * warm):
                    if w >= warm and time.perf_counter() - t0 >= SETTLE_S:
                        break
                    fn(w % warm)
                times[name] += [self.once(fn, k + j) for j in range(block)]
            k += block
        return times


def _summary(times: list[float], nbytes: int) -> dict:
    q = np.quantile(times, [0.1, 0.5, 0.9])
    return {
        "median_us": q[1] * 1e6,
        "p10_us": q[0] * 1e6,
        "p90_us": q[2] * 1e6,
        "gbps": nbytes / q[1] / 1e9,
        "calls": len(times),
    }


def _host_summary(per_call: list[float], calls: int) -> dict:
    return {
        "median_us": float(np.median(per_call)) * 1e6,
        "rounds_us": [t * 1e6 for t in per_call],
        "calls": calls,
        "rows": HOST_ROWS,
    }


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _drop_cache(layout: ShardLayout) -> None:
    for path in layout.files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm_cache(layout: ShardLayout) -> None:
    for path in layout.files:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def run(cfg: Config, log: Callable[[str], None] = print) -> dict:
    device = ple_um.access.capabilities.resolve_device(cfg.device)
    directory = cfg.directory or default_table(cfg)
    layout = read_layout(directory)
    report = ple_um.probe(device, table_bytes=layout.nbytes)
    cuda = device.type == "cuda"
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "table": {
            "directory": directory,
            "num_rows": layout.num_rows,
            "row_bytes": layout.row_bytes,
            "shards": layout.parts,
            "bytes": layout.nbytes,
            "dtype": layout.dtype_name,
        },
        "probe": report.as_dict(),
        "ids": {dist.name: dist.describe() for dist in cfg.ids},
        "anchor": {
            "name": ANCHOR,
            "memory": "GPU memory" if cuda else "host memory (no CUDA device)",
        },
        "method": {
            "timed_calls": cfg.repeats,
            "rounds": max(1, min(cfg.rounds, cfg.repeats)),
            "warmup_calls": cfg.warmup,
            "settle_s": SETTLE_S,
            "clock": "CUDA events" if cuda else "perf_counter",
            "host_overhead": {
                "calls": cfg.host_calls,
                "rows": HOST_ROWS,
                "clock": "perf_counter around the calls, one device sync at the end",
            },
        },
        "lookup": {},
        "decode_step": {},
        "startup": {},
    }
    log(
        f"table: {layout.num_rows} rows x {layout.row_bytes} B = {layout.nbytes / (1 << 30):.2f} GiB in "
        f"{layout.parts} shards ({directory})"
    )
    log(report.describe())
    if not cuda:
        log(
            "no CUDA device: only the cpu mode, the seeds' CPU path and the torch anchor (gathering "
            "from a copy of the table in host memory) run here"
        )
    timer = _Timer(device)
    rng = np.random.default_rng(cfg.seed)
    _warm_cache(layout)

    modes = cfg.modes or (("ats", "registered", "cpu", "device") if cuda else ("cpu",))
    contenders: dict[str, Callable[[], object]] = {}
    if layout.is_nvfp4:
        # The anchor, the seeds and the pinned-host kernel read raw rows; an NVFP4 table is decoded.
        result["anchor"]["left_out"] = "NVFP4 table: ple-um decodes rows, the anchor would only copy bytes"
        log("NVFP4 table: ple-um decodes rows to bf16; the raw-row contenders (and the anchor) are left out")
    else:
        contenders[ANCHOR] = lambda: TorchResident(layout, device)
    for mode in modes:
        contenders[f"ple-um {mode}"] = lambda m=mode: ple_um.open_table(directory, mode=m, device=device)
    if not layout.is_nvfp4:
        if cuda:
            contenders["vllm pinned-host"] = lambda: VllmPinnedHost(layout, device)
        contenders["seeds cpu"] = lambda: SeedsCpuPath(layout, device)

    impls: dict[str, object] = {}
    try:
        for name, make in contenders.items():
            try:
                t0 = time.perf_counter()
                impl = make()
                build = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - a path this machine cannot run is reported, not fatal
                result["lookup"][name] = {"skipped": f"{type(exc).__name__}: {exc}"}
                log(f"{name}: skipped ({exc})")
                if name in ("ple-um ats", "ple-um registered") and cuda:
                    result["lookup"][f"{name} kernel-only"] = result["lookup"][name]
                continue
            impls[name] = impl
            entry: dict = {"build_s": build}
            result["lookup"][name] = entry
            if isinstance(impl, ple_um.MappedTable):
                entry["mode"] = impl.mode
                entry["bulk_rows"] = impl.bulk_rows
                entry["bulk_calibration_s"] = impl.bulk_calibration
                entry["host_row_reads"] = impl.row_reads
                entry["capture_safe"] = impl.capture_safe
                if impl.mode in ("ats", "registered") and cuda:
                    # The same table with the GPU kernel for every batch size (no CPU bulk path).
                    impls[f"{name} kernel-only"] = KernelOnly(impl)
                    result["lookup"][f"{name} kernel-only"] = {"mode": impl.mode, "bulk_rows": None}

        def draw(dist: IdDistribution, n: int, sets: int) -> list[torch.Tensor]:
            return [torch.from_numpy(dist.draw(rng, layout.num_rows, n)).to(device) for _ in range(sets)]

        for dist in cfg.ids:
            log(f"ids: {dist.name}")
            # -- 1. lookups, side by side (each path its own fresh ids: none reads rows another
            # path has just brought into a cache) --------------------------------------------
            for n in cfg.rows:
                fns = {
                    name: _lookup_call(impl, draw(dist, n, cfg.repeats + cfg.warmup), layout, n, device)
                    for name, impl in impls.items()
                }
                times = timer.side_by_side(fns, cfg.repeats, cfg.warmup, cfg.rounds)
                for name, t in times.items():
                    row = result["lookup"][name].setdefault(dist.name, {})[str(n)] = _summary(
                        t, n * layout.row_bytes
                    )
                    log(f"{name:30s} {n:>8d} rows  {row['median_us']:10.1f} us")
                del fns, times
            # -- 2. host overhead: back-to-back eager calls of HOST_ROWS rows ------------------
            sets = timer.back_to_back_sets(cfg.host_calls, cfg.rounds)
            fns = {
                name: _lookup_call(
                    impl,
                    torch.from_numpy(dist.draw(rng, layout.num_rows, sets * HOST_ROWS))
                    .view(sets, HOST_ROWS)
                    .to(device),
                    layout,
                    HOST_ROWS,
                    device,
                )
                for name, impl in impls.items()
            }
            for name, per_call in timer.back_to_back(fns, cfg.host_calls, cfg.rounds).items():
                host = result["lookup"][name][dist.name]["host"] = _host_summary(per_call, cfg.host_calls)
                log(f"{name:30s} host {host['median_us']:10.1f} us per call, {cfg.host_calls} back to back")
            del fns
        # -- 3. decode step, eager and graph-replayed, side by side ---------------------------
        check = draw(cfg.ids[0], cfg.decode_tokens * cfg.heads, 3)
        steps = {name: _DecodeStep(impl, layout, device, cfg, check) for name, impl in impls.items()}
        nbytes = cfg.decode_tokens * cfg.heads * layout.row_bytes
        for name, st in steps.items():
            result["decode_step"][name] = {"capture_safe": st.capture_safe}
            if st.graph is not None:
                result["decode_step"][name]["graph_replay_equals_eager"] = st.graph_ok
        for dist in cfg.ids:
            sets = {
                name: draw(dist, cfg.decode_tokens * cfg.heads, cfg.repeats + cfg.warmup) for name in steps
            }
            eager = timer.side_by_side(
                {name: (lambda k, st=st, s=sets[name]: st.eager(s[k])) for name, st in steps.items()},
                cfg.repeats,
                cfg.warmup,
                cfg.rounds,
            )
            for name in steps:
                result["decode_step"][name][dist.name] = {"eager": _summary(eager[name], nbytes)}
            graphs = {
                name: (lambda k, st=st, s=sets[name]: st.replay(s[k]))
                for name, st in steps.items()
                if st.graph is not None
            }
            if graphs:
                for name, t in timer.side_by_side(graphs, cfg.repeats, cfg.warmup, cfg.rounds).items():
                    result["decode_step"][name][dist.name]["graph"] = _summary(t, nbytes)
            del sets, graphs
        del steps
    finally:
        for impl in impls.values():
            impl.close()
        if cuda:
            torch.cuda.empty_cache()
    ratios(result)

    # -- 4. start-up and memory -------------------------------------------------------------
    result["startup"] = _startup(directory, layout, device)
    if cfg.processes >= 1:
        result["processes"] = {
            kind: _processes(directory, kind, cfg.processes, device)
            for kind in (("ple-um", "vllm pinned-host") if cuda and not layout.is_nvfp4 else ("ple-um",))
        }
    return result


def _is_table(impl) -> bool:
    return isinstance(impl, (ple_um.MappedTable, KernelOnly))


def _lookup_call(impl, ids, layout: ShardLayout, n: int, device: torch.device) -> Callable[[int], object]:
    """fn(k): one lookup of ``ids[k]`` (n ids) by ``impl`` into an output allocated here, once."""
    out = torch.empty((n, layout.row_bytes), dtype=torch.uint8, device=device)
    if _is_table(impl):
        view = _lookup_buffer(layout, n, device) if layout.is_nvfp4 else out.view(layout.dtype)
        return lambda k: impl.lookup(ids[k], out=view)
    return lambda k: impl.lookup(ids[k], out)


class KernelOnly:
    """A GPU-mode table with the GPU kernel for every batch size: its bulk path switched off for
    the call. Shares the table (one mapping, one registration); closing it leaves the table open."""

    def __init__(self, table) -> None:
        self.table = table
        self.capture_safe = table.capture_safe

    def lookup(self, ids: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        saved, self.table.bulk_rows = self.table.bulk_rows, None
        try:
            return self.table.lookup(ids, out=out)
        finally:
            self.table.bulk_rows = saved

    def close(self) -> None:
        pass


def _mem_available() -> int:
    return ple_um.access.probe.mem_available()


def _serve(directory: str, kind: str, device: str) -> None:
    """Child process (see _processes): open the table one way, print the mode it is served in,
    wait for stdin to close, close the table."""
    dev = torch.device(device)
    if kind == "ple-um":
        impl = ple_um.open_table(directory, device=dev)
        mode = impl.mode
    else:
        impl = VllmPinnedHost(read_layout(directory), dev)
        mode = "pinned copy"
    print(mode, flush=True)
    sys.stdin.read()
    impl.close()


def _processes(directory: str, kind: str, count: int, device: torch.device) -> dict:
    """Host memory as ``count`` processes open the same table one after the other (one TP1
    replica per GPU): MemAvailable before and after each is ready. The children are fresh
    interpreters (not multiprocessing's spawn, which re-runs the parent's main script where that
    lacks a ``__main__`` guard); one that dies before it is ready is reported, not waited for."""
    _warm_cache(read_layout(directory))
    steps = [_mem_available()]
    children: list[subprocess.Popen] = []
    mode = None
    serve = "import sys; from ple_um.bench.runner import _serve; _serve(*sys.argv[1:])"
    try:
        for _ in range(count):
            proc = subprocess.Popen(
                [sys.executable, "-c", serve, directory, kind, str(device)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            children.append(proc)
            mode = proc.stdout.readline().strip()
            if not mode:  # its stdout closed: it died before it was ready
                proc.wait()
                why = f"a {kind} process exited with {proc.returncode} before it was ready (its stderr above)"
                return {"skipped": why}
            steps.append(_mem_available())
    finally:
        for proc in children:
            proc.stdin.close()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    drops = [steps[0] - s for s in steps[1:]]
    return {"mode": mode, "mem_available_drop_bytes": drops}


def _lookup_buffer(layout: ShardLayout, n: int, device: torch.device) -> torch.Tensor:
    """Where an NVFP4 lookup decodes to: bf16 rows."""
    return torch.empty((n, layout.row_dim), dtype=torch.bfloat16, device=device)


class _DecodeStep:
    """ids [T, heads] -> lookup -> dequant -> short projection, with its own buffers:
    ``eager(ids)`` runs it, ``replay(ids)`` replays its CUDA graph. ``graph`` is None where the
    contender is not capture-safe (its ``capture_safe``, as the table reports it) or there is no
    CUDA; ``graph_ok``: replays of the ``check`` id sets equal the eager step."""

    def __init__(self, impl, layout: ShardLayout, device: torch.device, cfg: Config, check) -> None:
        T, H = cfg.decode_tokens, cfg.heads
        self.impl, self.layout, self.T, self.H = impl, layout, T, H
        self.proj = torch.randn(layout.row_dim, 64, dtype=torch.bfloat16, device=device) / 16
        self.ids = torch.zeros((T * H,), dtype=torch.int64, device=device)
        self.raw = torch.empty((T * H, layout.row_bytes), dtype=torch.uint8, device=device)
        self.scale = torch.tensor(layout.scale or 1.0, dtype=torch.float32, device=device)
        self.is_table = _is_table(impl)
        self.decoded = _lookup_buffer(layout, T * H, device) if layout.is_nvfp4 else None
        self.capture_safe = bool(getattr(impl, "capture_safe", False))
        self.graph = None
        self.graph_ok = False
        if device.type == "cuda" and self.capture_safe:
            self.ids.copy_(check[0])
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self.step()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.y = self.step()
            ok = True
            for ids in check:
                self.replay(ids)
                ok &= bool(torch.equal(self.y, self.step()))
            self.graph_ok = ok

    def step(self) -> torch.Tensor:
        layout, impl = self.layout, self.impl
        if self.decoded is not None:  # NVFP4: the lookup decodes
            impl.lookup(self.ids, out=self.decoded)
            rows = self.decoded
        else:
            if self.is_table:
                impl.lookup(self.ids, out=self.raw.view(layout.dtype))
            else:
                impl.lookup(self.ids, self.raw)
            rows = (self.raw.view(layout.dtype).float() * self.scale).to(torch.bfloat16)
        return (rows @ self.proj).view(self.T, self.H, -1).sum(1)

    def eager(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        return self.step()

    def replay(self, ids: torch.Tensor) -> None:
        self.ids.copy_(ids)
        self.graph.replay()


def ratios(result: dict) -> None:
    """Add ``vs_torch`` to every timed figure that the anchor has too (same ids, same batch size,
    same kind): the figure's median over the anchor's."""
    for section in ("lookup", "decode_step"):
        base = result[section].get(ANCHOR, {})
        for entry in result[section].values():
            for dist in result["ids"]:
                mine, ref = entry.get(dist, {}), base.get(dist, {})
                for key, row in mine.items():
                    if key in ref:
                        row["vs_torch"] = row["median_us"] / ref[key]["median_us"]


def _startup(directory: str, layout: ShardLayout, device: torch.device) -> dict:
    out = {}
    for label, prep in (("cold", _drop_cache), ("warm", _warm_cache)):
        prep(layout)
        gpu0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        anon0 = _rss_anon()
        t0 = time.perf_counter()
        with ple_um.open_table(directory, device=device) as table:
            seconds = time.perf_counter() - t0
            stats = table.stats()
            out[label] = {
                "mode": table.mode,
                "open_s": seconds,
                "gpu_bytes": (torch.cuda.memory_allocated(device) - gpu0) if device.type == "cuda" else 0,
                "anon_rss_added_bytes": _rss_anon() - anon0,
                "pinned_bytes": stats["pinned_bytes"],
            }
    return out


def _cell(r: dict | None, gbps: bool = True) -> str:
    if r is None:
        return "-"
    extra = [f"{r['gbps']:.2f} GB/s"] if gbps else []
    if "vs_torch" in r:
        extra.append(f"{r['vs_torch']:.2f}x")
    return f"{r['median_us']:.1f}" + (f" ({', '.join(extra)})" if extra else "")


def format_table(result: dict, rows: tuple[int, ...]) -> str:
    anchor = result["anchor"]
    host = result["method"]["host_overhead"]
    lines = [
        f"device: {result['device']}   table: {result['table']['bytes'] / (1 << 30):.2f} GiB, "
        f"{result['table']['row_bytes']} B rows, {result['table']['shards']} shards   "
        f"auto mode: {result['probe']['mode']}",
        f"x torch: the ratio to `{anchor['name']}` over the table in {anchor['memory']}"
        + (f" (left out: {anchor['left_out']})" if "left_out" in anchor else ""),
    ]
    for dist in result["ids"]:
        lines += ["", f"lookups, {dist} ids"]
        head = (
            "| path | "
            + " | ".join(f"{n} rows: median us (GB/s, x torch)" for n in rows)
            + f" | host: us per call, {host['calls']} x {host['rows']} rows back to back (x torch) |"
        )
        lines += [head, "|" + " --- |" * (len(rows) + 2)]
        for name, entry in result["lookup"].items():
            if "skipped" in entry:
                lines.append(f"| {name} | skipped: {entry['skipped']} |")
                continue
            mine = entry.get(dist, {})
            cells = [_cell(mine.get(str(n))) for n in rows] + [_cell(mine.get("host"), gbps=False)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    heads = [
        f"{dist}: {kind} median us (x torch)" for dist in result["ids"] for kind in ("eager", "graph replay")
    ]
    lines += [
        "",
        "| decode step (64 tokens x 16 rows -> dequant -> proj) | " + " | ".join(heads) + " |",
        "|" + " --- |" * (len(heads) + 1),
    ]
    for name, d in result["decode_step"].items():
        absent = "not capture-safe" if not d["capture_safe"] else "no CUDA graphs on the CPU"
        cells = []
        for dist in result["ids"]:
            runs = d.get(dist, {})
            cells += [
                _cell(runs.get("eager"), gbps=False),
                _cell(runs["graph"], gbps=False) if "graph" in runs else absent,
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| open | mode | seconds | GPU bytes | anon RSS added | pinned bytes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, s in result["startup"].items():
        lines.append(
            f"| {label} page cache | {s['mode']} | {s['open_s']:.3f} | {s['gpu_bytes']} | "
            f"{s['anon_rss_added_bytes'] / (1 << 20):.1f} MiB | {s['pinned_bytes']} |"
        )
    if result.get("processes"):
        lines += [
            "",
            "| processes opening the same table | mode | host memory taken after 1st, 2nd, ... |",
            "| --- | --- | --- |",
        ]
        for kind, p in result["processes"].items():
            if "skipped" in p:
                lines.append(f"| {kind} | skipped: {p['skipped']} | |")
                continue
            drops = ", ".join(f"{d / (1 << 30):.2f} GiB" for d in p["mem_available_drop_bytes"])
            lines.append(f"| {kind} | {p['mode']} | {drops} |")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
