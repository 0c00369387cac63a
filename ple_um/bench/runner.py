"""The benchmark: every lookup path this machine can run, on one table, in one run.

Every contender is open at once and measured side by side: each timed round times a block of
every contender's calls, each block after its own warm-up, in an order rotated from round to
round, so drift in the host's speed over the run (other tenants, clocks, background work) falls on
all of them alike instead of on whichever ran at a bad moment. Fresh ids for every timed call
(drawn ahead, uniform or Zipf-hashed: ``bench/ids.py``), CUDA events on a GPU (perf_counter on the
CPU), medians with p10/p90, bytes/s of useful rows, and every median's ratio to the anchor: plain
``torch.index_select`` over the table resident in GPU memory. Beside the medians, the host's cost
of an eager call: wall time per call of back-to-back 16-row calls with one sync at the end. Then a
decode step, eager and graph-replayed, and start-up and memory figures (``bench/footprint.py``).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch
import triton

import ple_um
from ple_um import units
from ple_um.access.capabilities import on_device, resolve_device
from ple_um.bench import contenders as known
from ple_um.bench import timing
from ple_um.bench.config import Config, bench_layout, open_ple_um
from ple_um.bench.contenders import ANCHOR
from ple_um.bench.footprint import processes, read_cache, startup
from ple_um.bench.ids import IdDistribution
from ple_um.checkpoint import ShardLayout
from ple_um.errors import PleUmError


def versions() -> dict:
    """The versions a reader needs to compare two runs (vLLM's from its metadata, not imported)."""
    found = {
        "ple-um": ple_um.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "kernel": platform.release(),
    }
    try:
        found["vllm"] = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        found["vllm"] = None
    return found


def run_header(cfg: Config, layout: ShardLayout, device: torch.device) -> dict:
    """What every bench result opens with: which run (``Config.kind``), when, the command, the
    machine, the versions, the table, the id distributions."""
    cuda = device.type == "cuda"
    return {
        "kind": cfg.kind,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": cfg.command,
        "host": platform.node(),
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)",
        "versions": versions(),
        "table": {
            "directory": layout.directory,
            "layer": layout.layer,
            "num_rows": layout.num_rows,
            "row_bytes": layout.row_bytes,
            "shards": layout.parts,
            "bytes": layout.nbytes,
            "dtype": layout.dtype_name,
        },
        "ids": {dist.name: dist.describe() for dist in cfg.ids},
    }


def read_bytes(layout: ShardLayout) -> int:
    """Bytes of the table a lookup reads per row: the row and its block scales (NVFP4, MXFP8)."""
    return layout.nbytes // layout.num_rows


def _describe_run(cfg: Config, layout: ShardLayout, report, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {
        **run_header(cfg, layout, device),
        "probe": report.as_dict(),
        "anchor": {"name": ANCHOR, "memory": "GPU memory" if cuda else "host memory (no CUDA device)"},
        "method": {
            "rows": list(cfg.rows),
            "timed_calls": cfg.repeats,
            "rounds": max(1, min(cfg.rounds, cfg.repeats)),
            "warmup_calls": cfg.warmup,
            "settle_s": timing.SETTLE_S,
            "decode_step": {"tokens": cfg.decode_tokens, "heads": cfg.heads},
            "clock": "CUDA events" if cuda else "perf_counter",
            "host_overhead": {
                "calls": cfg.host_calls,
                "rows": timing.HOST_ROWS,
                "clock": "perf_counter around the calls, one device sync at the end",
            },
        },
        "contenders": {},
        "lookup": {},
        "decode_step": {},
        "startup": {},
    }


def _contenders(cfg: Config, layout: ShardLayout, device: torch.device, result: dict) -> dict:
    """name -> a function that opens that contender, in the order the tables list them."""
    cuda = device.type == "cuda"
    modes = cfg.run_modes(cuda)
    makers: dict[str, Callable[[], object]] = {}
    if layout.is_nvfp4:
        # The anchor, vllm_ple_mmap's CPU gather and the pinned-host kernel read raw rows, and
        # ple-um decodes an NVFP4 table's: they are left out for one.
        result["anchor"]["left_out"] = "NVFP4 table: ple-um decodes rows, the anchor would only copy bytes"
    else:
        makers[ANCHOR] = lambda: known.TorchResident(layout, device)
    for mode in modes:
        makers[f"ple-um {mode}"] = lambda m=mode: open_ple_um(layout, device, m)
    if layout.is_mxfp8:  # vLLM's stock Engram storage; the seeds never served an Engram table
        if cuda:
            pinned = "vllm pinned-host" if known.vllm_engram_kernel() else known.ENGRAM_STAND_IN
            makers[pinned] = lambda: known.VllmEngramPinned(layout, device)
    elif not layout.is_nvfp4:
        if cuda:
            makers["vllm pinned-host"] = lambda: known.VllmPinnedHost(layout, device)
        makers["seeds cpu"] = lambda: known.SeedsCpuPath(layout, device)
    return makers


def _open(
    makers: dict, layout: ShardLayout, device: torch.device, result: dict, log: Callable[[str], None]
) -> dict:
    """Open every contender: name -> its lookup object. One this machine cannot run is reported
    (``skipped``, with why), not fatal; a GPU-mode table adds its kernel-only view."""
    cuda = device.type == "cuda"
    memory = result["anchor"]["memory"]
    impls: dict[str, object] = {}
    for name, make in makers.items():
        result["contenders"][name] = known.describe(name, memory, layout.is_mxfp8)
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
            entry.update(mode=impl.mode, bulk_rows=impl.bulk_rows, bulk_calibration_s=impl.bulk_calibration)
            entry.update(host_row_reads=impl.row_reads, capture_safe=impl.capture_safe)
            if impl.mode in ("ats", "registered") and cuda:
                # The same table with the GPU kernel for every batch size (no CPU bulk path).
                only = f"{name} kernel-only"
                impls[only] = timing.KernelOnly(impl)
                result["lookup"][only] = {"mode": impl.mode, "bulk_rows": None}
                result["contenders"][only] = known.describe(only, memory, layout.is_mxfp8)
    return impls


class _Ids:
    """Fresh id sets on the device, drawn from one generator for the whole run."""

    def __init__(self, layout: ShardLayout, device: torch.device, seed: int) -> None:
        self.num_rows, self.device = layout.num_rows, device
        self.rng = np.random.default_rng(seed)

    def sets(self, dist: IdDistribution, n: int, count: int) -> list[torch.Tensor]:
        return [torch.from_numpy(dist.draw(self.rng, self.num_rows, n)).to(self.device) for _ in range(count)]

    def block(self, dist: IdDistribution, n: int, count: int) -> torch.Tensor:
        """``count`` sets of ``n`` ids as one [count, n] tensor (the host-overhead burst), each drawn
        as a lookup of ``n`` ids is: under a trace, the next decode step of as many requests as they
        have tokens, not a slice of one prefill chunk of ``count`` times as many tokens."""
        drawn = np.stack([dist.draw(self.rng, self.num_rows, n) for _ in range(count)])
        return torch.from_numpy(drawn).to(self.device)


def _time_lookups(cfg, layout, device, impls, ids: _Ids, dist, timer: timing.Timer, result, log) -> None:
    """Lookups side by side at every batch size, then the host-overhead burst, for one id
    distribution. Each path gets its own fresh ids: none reads rows another has just cached."""
    for n in cfg.rows:
        fns = {
            name: timing.lookup_call(impl, ids.sets(dist, n, cfg.repeats + cfg.warmup), layout, n, device)
            for name, impl in impls.items()
        }
        times = timer.side_by_side(fns, cfg.repeats, cfg.warmup, cfg.rounds)
        for name, t in times.items():
            row = timing.summary(t, n * read_bytes(layout))
            result["lookup"][name].setdefault(dist.name, {})[str(n)] = row
            log(f"{name:30s} {n:>8d} rows  {row['median_us']:10.1f} us")
        del fns, times
    sets = timer.back_to_back_sets(cfg.host_calls, cfg.rounds)
    fns = {
        name: timing.lookup_call(
            impl, ids.block(dist, timing.HOST_ROWS, sets), layout, timing.HOST_ROWS, device
        )
        for name, impl in impls.items()
    }
    for name, per_call in timer.back_to_back(fns, cfg.host_calls, cfg.rounds).items():
        host = result["lookup"][name][dist.name]["host"] = timing.host_summary(per_call, cfg.host_calls)
        log(f"{name:30s} host {host['median_us']:10.1f} us per call, {cfg.host_calls} back to back")


def _time_decode(cfg, layout, device, impls, ids: _Ids, timer: timing.Timer, result) -> None:
    """The decode step of every contender, eager and graph-replayed, side by side."""
    n = cfg.decode_tokens * cfg.heads
    check = ids.sets(cfg.ids[0], n, 3)
    steps = {
        name: timing.DecodeStep(impl, layout, device, cfg.decode_tokens, cfg.heads, check)
        for name, impl in impls.items()
    }
    nbytes = n * read_bytes(layout)
    for name, st in steps.items():
        result["decode_step"][name] = {"capture_safe": st.capture_safe}
        if st.graph is not None:
            result["decode_step"][name]["graph_replay_equals_eager"] = st.graph_ok
    for dist in cfg.ids:
        sets = {name: ids.sets(dist, n, cfg.repeats + cfg.warmup) for name in steps}
        # Every step eagerly, then the captured ones replayed: each kind side by side.
        calls = {
            "eager": {name: st.eager for name, st in steps.items()},
            "graph": {name: st.replay for name, st in steps.items() if st.graph is not None},
        }
        for kind, by_name in calls.items():
            fns = {name: (lambda k, f=f, s=sets[name]: f(s[k])) for name, f in by_name.items()}
            # No graph: no CUDA, or no contender capture-safe.
            times = timer.side_by_side(fns, cfg.repeats, cfg.warmup, cfg.rounds) if fns else {}
            for name, t in times.items():
                result["decode_step"][name].setdefault(dist.name, {})[kind] = timing.summary(t, nbytes)


def run(cfg: Config, log: Callable[[str], None] = print) -> dict:
    device = resolve_device(cfg.device)
    layout = bench_layout(cfg)
    report = ple_um.probe(device, table_bytes=layout.nbytes)
    result = _describe_run(cfg, layout, report, device)
    cuda = device.type == "cuda"
    log(
        f"table: {layout.num_rows} rows x {read_bytes(layout)} B = {units.format_bytes(layout.nbytes)} "
        f"in {layout.parts} shards (layer {layout.layer}, {layout.directory})"
    )
    log(report.describe())
    if not cuda:
        seeds = "" if layout.is_mxfp8 else ", the seeds' CPU path"
        log(
            f"no CUDA device: only the cpu mode{seeds} and the torch anchor (gathering from a copy of "
            "the table in host memory) run here"
        )
    if layout.is_nvfp4:
        log("NVFP4 table: ple-um decodes rows to bf16; the raw-row contenders (and the anchor) are left out")
    read_cache(layout)
    timer, ids = timing.Timer(device), _Ids(layout, device, cfg.seed)
    with on_device(device):  # the events, streams and graphs below: the device's
        impls = _open(_contenders(cfg, layout, device, result), layout, device, result, log)
        try:
            for dist in cfg.ids:
                log(f"ids: {dist.name}")
                _time_lookups(cfg, layout, device, impls, ids, dist, timer, result, log)
            _time_decode(cfg, layout, device, impls, ids, timer, result)
        finally:
            for impl in impls.values():
                impl.close()
            if cuda:
                torch.cuda.empty_cache()
    ratios(result)
    result["startup"] = _or_skipped(lambda: startup(layout, device))
    if cfg.processes >= 1:
        pinned = cuda and not layout.has_block_scales
        kinds = ("ple-um", "vllm pinned-host") if pinned else ("ple-um",)
        result["processes"] = {
            kind: _or_skipped(lambda k=kind: processes(layout, k, cfg.processes, device)) for kind in kinds
        }
    return result


def _or_skipped(measure: Callable[[], dict]) -> dict:
    """``measure()``'s open figures, or why there are none where the table's files went or changed
    since its lookups were timed (``skipped``): the lookups' figures are kept."""
    try:
        return measure()
    except (OSError, PleUmError) as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}


def ratios(result: dict) -> None:
    """Add ``vs_torch`` to every timed figure that the anchor has too (same id distribution, same
    batch size, same kind; each path's ids are draws of its own): the figure's median over the
    anchor's."""
    for section in ("lookup", "decode_step"):
        base = result[section].get(ANCHOR, {})
        for entry in result[section].values():
            for dist in result["ids"]:
                mine, ref = entry.get(dist, {}), base.get(dist, {})
                for key, row in mine.items():
                    if key in ref:
                        row["vs_torch"] = row["median_us"] / ref[key]["median_us"]
