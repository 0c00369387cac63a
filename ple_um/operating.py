"""Operating a table's checkpoint from outside the server: inspect it, measure how much of it is in
the page cache, and prewarm it. What the `ple-um inspect`, `residency` and `prewarm` verbs print.

Everything here works on the files alone (headers, mmaps, mincore): no device, no table.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator

import numpy as np

from ple_um.access.memory import mem_available
from ple_um.checkpoint import ShardLayout, read_layout
from ple_um.checkpoint.layout import find_layers, validate
from ple_um.errors import PleUmError
from ple_um.mapping import MappedShards
from ple_um.residency import PAGE, resident_bytes, resident_pages
from ple_um.units import format_bytes


class PrewarmRefused(PleUmError, RuntimeError):
    """A prewarm would read more than the memory it may fill; nothing was read."""


# -- inspect -------------------------------------------------------------------------------------
def file_name(directory: str, path: str) -> str:
    """How the verbs name a table's file: its path in the checkpoint ``directory``, as the index
    names it (``model-00001-of-00004.safetensors``, or ``a/model.safetensors``: an index may name
    files in folders, two of one base name among them)."""
    return os.path.relpath(path, directory)


def describe_layout(layout: ShardLayout) -> dict:
    """A sound layer's table as plain data: shape, dtype, bytes, scale, every shard and file."""
    files: dict[str, dict] = {}
    shards = []

    def entry(path: str) -> dict:
        name = file_name(layout.directory, path)
        return files.setdefault(name, {"file": name, "shards": [], "bytes": 0})

    for spec in layout.block_scales:  # each shard's block scales, in the file that holds them
        entry(spec.path)["bytes"] += spec.rows * (layout.row_dim // layout.block_size)
    for spec in layout.shards:
        nbytes = spec.rows * layout.row_bytes
        shards.append(
            {
                "index": spec.index,
                "file": file_name(layout.directory, spec.path),
                "tensor": spec.tensor,
                "offset": spec.offset,
                "rows": spec.rows,
                "bytes": nbytes,
            }
        )
        entry(spec.path)["shards"].append(spec.index)
        entry(spec.path)["bytes"] += nbytes
    return {
        "layer": layout.layer,
        "dtype": layout.dtype_name,
        "rows": layout.num_rows,
        "row_dim": layout.row_dim,
        "row_bytes": layout.row_bytes,
        "bytes": layout.nbytes,
        "parts": layout.parts,
        "rows_per_shard": layout.rows_per_shard,
        "scale": layout.scale,
        "scale_tensor": layout.scale_tensor,
        "files": list(files.values()),
        "shards": shards,
    }


def inspect(directory: str, layer: int | None = None) -> dict:
    """What the checkpoint at ``directory`` holds and whether it is sound.

    Returns ``{"directory", "layers", "valid", "problems", "tables"}``: the PLE layers found in the
    headers and the index that can be read (None when none can be), every problem (an empty list
    when sound; one per broken file), and for each sound layer looked at (``layer``, else every
    layer found) its table."""
    directory = os.path.abspath(directory)
    layers = find_layers(directory, strict=False)  # validate() below lists what cannot be read
    targets: list[int | None] = [layer] if layer is not None else list(layers or ()) or [None]
    problems: list[str] = []
    tables = []
    for at in targets:
        found = validate(directory, at)
        problems += [p for p in found if p not in problems]
        if not found:
            tables.append(describe_layout(read_layout(directory, at)))
    return {
        "directory": directory,
        "layers": layers,
        "valid": not problems and bool(tables),
        "problems": problems,
        "tables": tables,
    }


# -- residency -----------------------------------------------------------------------------------
# resident_rows asks mincore about each row's own pages while the rows are fewer than the mapping's
# pages over this, and about whole files otherwise.
ROW_BY_ROW = 64


def resident_rows(mapping: MappedShards, ids: np.ndarray, *, whole_files: bool | None = None) -> np.ndarray:
    """For each id (owned by ``mapping``), whether all of its row's bytes are in the page cache
    now: mincore, no data read. Ids the mapping does not own read as False. ``whole_files``: one
    mincore per mapped file (True), or one over each row's pages (False); None picks the lighter
    (a whole file's mincore walks every page of it, which a few rows need not wait for)."""
    layout = mapping.layout
    rb, per_shard = layout.row_bytes, layout.rows_per_shard
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if whole_files is None:
        whole_files = ids.size * ROW_BY_ROW >= sum(r.length for r in mapping.regions) // PAGE
    # Per mapped file, the running count of its resident pages: a row is resident when every page
    # from its first to its last is.
    seen = None
    if whole_files:
        seen = [np.concatenate([[0], np.cumsum(resident_pages(r), dtype=np.int64)]) for r in mapping.regions]
    out = np.zeros(ids.shape, dtype=bool)
    shard = ids // per_shard
    for index, owned in mapping.owned.items():
        pick = np.flatnonzero(shard == index)
        if pick.size == 0:
            continue
        local = ids[pick] - index * per_shard
        inside = (local >= owned.lo) & (local < owned.hi)
        region = mapping.regions[owned.region]
        start = owned.addr - region.addr + (local - owned.lo) * rb
        pick, start = pick[inside], start[inside]
        first, last = start // PAGE, (start + rb - 1) // PAGE
        if seen is None:  # one mincore over each row's own pages (OSError naming the file)
            pages = zip(first.tolist(), (last - first + 1).tolist(), strict=True)
            out[pick] = [resident_pages(region, at, n).all() for at, n in pages]
        else:
            count = seen[owned.region]
            out[pick] = count[last + 1] - count[first] == last - first + 1
    return out


def residency(directory: str, layer: int | None = None) -> dict:
    """How much of the table is in the page cache right now: per shard, per file and in total; and
    the row cache a table opened now would take (``row_cache``).

    Maps the table read-only, asks mincore, unmaps; reads no data (so it does not change what it
    measures)."""
    with _mapped(read_layout(directory, layer)) as mappings:
        result = _residency(mappings[0])
        if len(mappings) > 1:  # the block scales are a table of their own, mapped beside the rows
            scales = _residency(mappings[1])
            result["block_scales"] = {k: scales[k] for k in ("shards", "files", "total")}
            result["total"] = _totals([result["total"], scales["total"]])
        result["row_cache"] = row_cache_plan(*mappings)
    return result


def row_cache_plan(mapping: MappedShards, scale_mapping: MappedShards | None = None) -> dict:
    """The row cache and the reader of misses the host path of a table opened now, under these
    knobs, would take (``lookup.host.misses.plan``). A serving process's own cache lives in that
    process: its ``stats()["row_cache"]``, stats line and ``vllm:ple_um_row_cache_*`` metrics."""
    from ple_um.errors import KnobError
    from ple_um.lookup import fit, rowcopy
    from ple_um.lookup.host import misses

    lib, why = rowcopy.for_open()
    if lib is None:
        return {"bytes": 0, "why": f"no row cache: the C row copy is not built here ({why})"}
    try:
        verdict = fit.measure([m for m in (mapping, scale_mapping) if m is not None])
        plan = misses.plan(lib, mapping, scale_mapping, spills=not verdict.fits)
    except KnobError as exc:  # a size past the memory left: the open would refuse it
        return {"bytes": 0, "why": f"an open now would be refused: {exc}"}
    if plan is None:
        why = "no row cache (the table fits in memory and is in the page cache); rows copied from the mapping"
        return {"bytes": 0, "why": why}
    return {
        "bytes": plan.cache_bytes,
        "policy": plan.policy if plan.cache_bytes else None,
        "reads": plan.strategy,
        "direct": plan.direct,
        "depth": plan.depth,
        "why": plan.why,
    }


def _residency(mapping: MappedShards) -> dict:
    """Per owned shard (mincore over its rows, a window at a time), per mapped file and in total, the bytes of
    ``mapping`` in the page cache."""
    rb, directory = mapping.layout.row_bytes, mapping.layout.directory
    shards = []
    for index, owned in sorted(mapping.owned.items()):
        path = mapping.regions[owned.region].path
        resident = resident_bytes(owned.addr, owned.rows * rb, path)
        name = file_name(directory, path)
        shards.append({"index": index, "file": name, **_share(owned.rows * rb, resident)})
    files = [
        {"file": file_name(directory, path), "mapped_bytes": mapped, "resident_bytes": resident}
        for path, resident, mapped in mapping.residency()
    ]
    return {
        "directory": mapping.layout.directory,
        "layer": mapping.layout.layer,
        "page_size": PAGE,
        "shards": shards,
        "files": files,
        "total": _totals(shards),
    }


@contextlib.contextmanager
def _mapped(layout: ShardLayout) -> Iterator[list[MappedShards]]:
    """The table's rows mapped read-only, and a block-scaled table's block scales beside them (every
    lookup reads both); unmapped when the block ends."""
    layouts = [layout, layout.scale_layout()] if layout.has_block_scales else [layout]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(MappedShards(each)) for each in layouts]


# -- prewarm -------------------------------------------------------------------------------------
def prewarm(
    directory: str,
    layer: int | None = None,
    *,
    fraction: float = 1.0,
    force: bool = False,
    limit: int | None = None,
    workers: int = 8,
    progress: Callable[[int, str], object] | None = None,
    available: Callable[[], int] = mem_available,
) -> dict:
    """Fill the page cache with the first ``fraction`` of the table's mapped bytes in each of its
    files (``MappedShards.populate``: each mapping's span, not the file's header or other tensors).

    Refuses (PrewarmRefused, nothing read) when that is more than ``limit`` bytes (default:
    ``available()``, MemAvailable): the cache would evict the table's own first pages, or other
    processes' memory, to hold the rest. ``force`` prewarms anyway. ``progress(total_bytes,
    description)`` returns a context manager yielding ``advance(nbytes)``
    (``ple_um.metrics.progress``). The kernel's readahead may bring in more than the fraction.
    Returns the bytes read, the seconds, and the residency before and after."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    layout = read_layout(directory, layer)
    with _mapped(layout) as mappings:
        requested = _requested(mappings, fraction)
        memory = available()
        allowed = memory if limit is None else int(limit)
        if requested > allowed and not force:
            what = "the --max-bytes limit" if limit is not None else "MemAvailable"
            fits = fraction_that_fits(mappings, fraction, allowed)
            advice = []
            if fits is not None:
                part = format_bytes(_requested(mappings, float(fits)))
                advice.append(f"prewarm a part with --fraction {fits} ({part})")
            if limit is not None:
                advice.append("raise --max-bytes")
            left = ", or ".join(filter(None, (", ".join(advice), "pass --force")))
            raise PrewarmRefused(
                f"prewarming layer {layout.layer} of {layout.directory} reads {format_bytes(requested)}, "
                f"more than {what} ({format_bytes(allowed)}): filling the page cache would evict the "
                f"table's own first pages (or other processes' memory) to hold the rest. "
                f"{left[0].upper()}{left[1:]}"
            )
        before = _total(mappings)
        t0 = time.perf_counter()
        with (progress or (lambda total, what: contextlib.nullcontext()))(requested, "prewarm") as advance:
            read = sum(m.populate(fraction, workers=workers, progress=advance) for m in mappings)
        seconds = time.perf_counter() - t0
        after = _total(mappings)
    return {
        "directory": layout.directory,
        "layer": layout.layer,
        "fraction": fraction,
        "requested_bytes": requested,
        "read_bytes": read,
        "mem_available": memory,
        "limit": allowed,
        "forced": bool(force and requested > allowed),
        "seconds": seconds,
        "before": before,
        "after": after,
    }


def _requested(mappings: list[MappedShards], fraction: float) -> int:
    """Bytes a prewarm of the first ``fraction`` of each mapped file asks for."""
    return sum(int(r.length * fraction) for m in mappings for r in m.regions)


def fraction_that_fits(mappings: list[MappedShards], fraction: float, allowed: int) -> str | None:
    """The largest fraction, written with two significant digits, whose prewarm asks for at most
    ``allowed`` bytes and for some bytes at all; None when there is none. It is written as the
    command line will read it back, and checked as read back."""
    requested = _requested(mappings, fraction)
    target = fraction * allowed / requested if requested else 1.0
    if target <= 0:
        return None
    step = 10.0 ** (math.floor(math.log10(target)) - 1)
    for k in range(int(target / step), 0, -1):
        text = f"{k * step:.2g}"
        asked = _requested(mappings, float(text))
        if 0 < asked <= allowed and float(text) <= 1:
            return text
    return None


def _share(nbytes: int, resident: int) -> dict:
    return {"bytes": nbytes, "resident_bytes": resident, "fraction": resident / nbytes if nbytes else 1.0}


def _totals(parts: list[dict]) -> dict:
    """The bytes, resident bytes and resident fraction of ``parts`` (shards, tables) together."""
    return _share(sum(p["bytes"] for p in parts), sum(p["resident_bytes"] for p in parts))


def _total(mappings: list[MappedShards]) -> dict:
    """The residency totals of several mappings together (a table's rows and block scales)."""
    return _totals([_residency(m)["total"] for m in mappings])
