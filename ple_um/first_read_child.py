"""The first-read child: the program ``access.first_read.run_child`` starts in a fresh interpreter.

It opens a few windows of the real table in the mode under test through ``open_table``, the public
API, as any user of the table would (the open path, above ``access/``, is why this program is a
module of its own), gathers their rows through the kernel and compares them, and the zero rows
beside them, with bytes read from the files. Before each window it asks the kernel to drop the
window's pages, so that the GPU's first touch reads them from the file. It prints its stage as it
goes and its verdict last, on stdout, behind ``first_read.MARK``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch

from ple_um import _testing
from ple_um.access.first_read import MARK, STAGES
from ple_um.checkpoint import ShardLayout, read_engram_layout, read_layout
from ple_um.residency import evict_file_pages
from ple_um.verify import rows_differ

_now = {"stage": "import"}  # the child's stage, for the reason of an error it reports


def _say(kind: str, text: str) -> None:
    if kind == "stage":
        _now["stage"] = text
    print(f"{MARK} {kind} {text}", flush=True)


def _evict(layout: ShardLayout, window: tuple[int, int]) -> None:
    """Ask the kernel to drop the window's pages from the page cache (pages another process maps
    stay), so that the GPU's first touch reads them from the file, as a serving process's does. A
    hint: nothing depends on it. Not written back: a freshly written shard's write-back, the whole
    file's, could outlast the child's time limit."""
    S, rb = layout.rows_per_shard, layout.row_bytes
    for spec in layout.shards:
        lo = max(window[0], spec.index * S)
        hi = min(window[1], spec.index * S + spec.rows)
        if hi <= lo:
            continue
        with contextlib.suppress(OSError):
            start = spec.offset + (lo - spec.index * S) * rb
            evict_file_pages(spec.path, start, (hi - lo) * rb, write_back=False)


def _inject(fault: str | None) -> None:
    """The test hook (``_testing.first_read_fault``), while the child reads through the kernel."""
    if fault == "segv":
        import ctypes

        ctypes.string_at(0)  # a read of address 0: SIGSEGV
    elif fault == "abort":
        os.abort()
    elif fault == "hang":
        while True:
            time.sleep(60)
    elif fault == "exit":
        os._exit(3)
    elif fault == "error":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


def _child_main(spec: dict) -> int:
    _say("stage", "import")
    import numpy as np

    from ple_um.opening import open_engram_table, open_table  # the public API, as any user opens a table

    fault = _testing.first_read_fault()
    engram = spec.get("engram", False)  # a DeepSeek-V4.1 Engram table, not a PLE one
    layout = (read_engram_layout if engram else read_layout)(spec["directory"], spec["layer"])
    opener = open_engram_table if engram else open_table
    rows = 0
    for lo, hi in spec["windows"]:
        for part in [layout, layout.scale_layout()] if layout.has_block_scales else [layout]:
            _evict(part, (lo, hi))
        _say("stage", "open")
        with opener(
            layout.directory, layer=layout.layer, rows=(lo, hi), mode=spec["mode"], device=spec["device"]
        ) as table:
            # The window's rows and two on each side, which the table does not own: zeros.
            ids_np = np.arange(max(0, lo - 2), min(layout.num_rows, hi + 2), dtype=np.int64)
            ids = torch.from_numpy(ids_np).to(table.device)
            _say("stage", "gather")
            _inject(fault)
            if layout.has_block_scales:
                packed, scales = table.lookup_packed(ids)
                got = torch.cat([packed.view(torch.uint8), scales.view(torch.uint8)], dim=1)
            else:
                got = table.lookup(ids).view(torch.uint8).reshape(ids_np.size, -1)
            if table.device.type == "cuda":
                torch.cuda.synchronize(table.device)  # a fault in the kernel surfaces here
            got = got.cpu().numpy().copy()
        _say("stage", "compare")
        if fault == "corrupt":
            got[got.shape[0] // 2, 0] ^= 0x5A
        reason = rows_differ(layout, ids_np, got, (lo, hi), how=" read through the kernel")
        if reason is not None:
            _say("result", json.dumps({"passed": False, "reason": reason}))
            return 0
        rows += ids_np.size
    _say("result", json.dumps({"passed": True, "rows": rows}))
    return 0


def main(argv: list[str]) -> int:
    """The child's entry (``_CHILD SPEC``): one first read; the verdict on stdout. Exit 0 with a
    verdict, 1 with an error reported as a rejection."""
    spec = json.loads(argv[0])
    try:
        return _child_main(spec)
    except Exception as exc:  # noqa: BLE001 - any error in the mode is its verdict
        doing = STAGES.get(_now["stage"], _now["stage"])
        _say("result", json.dumps({"passed": False, "reason": f"while {doing}: {type(exc).__name__}: {exc}"}))
        return 1
