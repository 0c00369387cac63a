"""SyncGather: the ``cpu`` mode's host path where the C row copy cannot be built (no working C
compiler, or ``PLE_UM_ROWCOPY=0``). It does the plain thing, synchronously: a lookup brings its ids
to the host (it waits for the device: not capture-safe), reads each shard's owned rows from the
mapping with ``torch.index_select`` (zeros for the ids it does not own), copies the rows to the
device and, for a float output, dequantizes or decodes them there (``decode.py``). An
NVFP4 or MXFP8 table's block scales are read the same way from their own mapping. A big lookup goes
a chunk of ids at a time (``PLE_UM_CPU_CHUNK``), so that its staging and decoding stay bounded. An
owned id whose row lies outside its shard's mapping is a zero row counted as broken, as the C row
copy gives and counts it.

Wherever the C row copy builds, the host path is ``host.gather.HostGather`` instead: stream-ordered,
no host sync, capture-safe.
"""

from __future__ import annotations

import threading
import time

import torch

from ple_um.lookup.counts import PHASES, path_counts
from ple_um.lookup.decode import decode_staged
from ple_um.mapping import MappedShards


class MappedRows:
    """The owned rows of one MappedShards, each shard a uint8 tensor [rows, row_bytes] over the
    mapping (no copy), read on the host."""

    def __init__(self, mapping: MappedShards) -> None:
        layout = mapping.layout
        self.row_bytes, self.rows_per_shard = layout.row_bytes, layout.rows_per_shard
        self.owned = (mapping.row_start, mapping.row_end)
        # shard index -> (global row of the view's first row, the view)
        self.shards = {
            index: (index * layout.rows_per_shard + shard.lo, torch.from_numpy(mapping.shard_rows(index)))
            for index, shard in mapping.owned.items()
        }
        self._unmapped = torch.empty((0, self.row_bytes), dtype=torch.uint8)  # a shard with no view

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The rows [n, row_bytes] of int64 host ``ids``, zeros where an id is not owned, and the
        number of broken rows: owned ids whose row lies outside their shard's mapping (a shard not
        mapped, a row past its mapped rows), zero rows too, as the C row copy gives and counts them."""
        rows = torch.zeros((ids.numel(), self.row_bytes), dtype=torch.uint8)
        owned = (ids >= self.owned[0]) & (ids < self.owned[1])
        shard = torch.where(owned, ids // self.rows_per_shard, -1)
        broken = 0
        for index in torch.unique(shard[owned]).tolist():
            at = torch.nonzero(shard == index).squeeze(1)
            first, view = self.shards.get(index, (0, self._unmapped))
            local = ids[at] - first
            inside = (local >= 0) & (local < view.shape[0])
            broken += at.numel() - int(inside.sum())
            rows.index_copy_(0, at[inside], torch.index_select(view, 0, local[inside]))
        return rows, broken


def row_reads(why: str) -> str:
    """How this path reads rows, in words, where the C row copy cannot be had (``why``)."""
    return f"torch.index_select, synchronous ({why})"


class SyncGather:
    """The synchronous host path of the ``cpu`` mode: reads the rows (and an NVFP4 or MXFP8 table's
    block scales, ``scale_mapping``), dequantizes or decodes them, and counts its lookups (on the
    host, under a lock). Every lookup waits for the device to read its ids: not capture-safe."""

    def __init__(
        self,
        mapping: MappedShards,
        device: torch.device,
        *,
        storage: torch.dtype,
        scale: torch.Tensor | None,
        chunk: int,
        why: str,
        scale_mapping: MappedShards | None = None,
    ) -> None:
        self.device = device
        self.storage = storage
        self.scale = scale
        self.num_rows = mapping.layout.num_rows
        self.chunk = max(1, chunk)
        self.rows = MappedRows(mapping)
        self.sources = [self.rows] + ([MappedRows(scale_mapping)] if scale_mapping is not None else [])
        self.row_reads = row_reads(why)
        self.counts = {"rows": 0, "out_of_range": 0, "broken": 0, "lookups": 0}
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.metrics = None  # the table's LookupMetrics, fed at each lookup (set once it serves)
        self._lock = threading.Lock()

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of flat ``ids`` into ``out`` [n, row_dim]: raw when out has the storage dtype (NVFP4:
        the packed bytes), else dequantized or decoded."""
        if out.dtype == self.storage or (len(self.sources) == 2 and out.dtype == torch.uint8):
            self._lookup(ids, [out.view(torch.uint8).view(ids.numel(), out.shape[-1] * out.element_size())])
        else:
            self._lookup(ids, None, decoded=out)
        return out

    def gather_packed(self, ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """NVFP4, MXFP8: the raw rows and block scales of ``ids`` (uint8)."""
        self._lookup(ids, [packed, scales])

    def _lookup(
        self, ids: torch.Tensor, raw: list[torch.Tensor] | None, decoded: torch.Tensor | None = None
    ) -> None:
        """One lookup of flat ``ids``, a chunk at a time: the raw bytes of the first ``len(raw)``
        sources (the rows, then the block scales) into ``raw``, or every source's decoded into
        ``decoded``. Phases: ``wait`` the ids' copy to the host (after the work queued before
        it), ``gather`` the reads of the mapping, ``stage`` the copies to the device and the
        decoding."""
        t0 = time.perf_counter()
        n = ids.numel()
        host_ids = ids.to(device="cpu", dtype=torch.int64)
        wait = time.perf_counter() - t0
        sources = self.sources if raw is None else self.sources[: len(raw)]
        gather, broken = 0.0, 0
        for a in range(0, n, self.chunk):
            b = min(a + self.chunk, n)
            tr = time.perf_counter()
            staged = []
            for source in sources:
                rows, lost = source.read(host_ids[a:b])
                staged.append(rows)
                broken += lost
            gather += time.perf_counter() - tr
            if raw is None:
                decode_staged(self.storage, [s.to(self.device) for s in staged], self.scale, decoded[a:b])
            else:
                for out, rows in zip(raw, staged, strict=True):
                    out[a:b].copy_(rows)
        bad = int(((host_ids < 0) | (host_ids >= self.num_rows)).sum())
        seconds = time.perf_counter() - t0
        phases = {"gather": gather, "stage": seconds - wait - gather, "wait": wait}
        with self._lock:  # lookups from several threads: += is not atomic
            self.counts["rows"] += n
            self.counts["out_of_range"] += bad
            self.counts["broken"] += broken
            self.counts["lookups"] += 1
            for key, value in phases.items():
                self.phases[key] += value
        if self.metrics is not None:
            self.metrics.observe(n, n * sum(s.row_bytes for s in sources), bad, phases, seconds)

    def read_counts(self) -> dict:
        """The lookups counted so far, as ``path_counts`` (phases: gather, stage, wait)."""
        with self._lock:
            return path_counts(**self.counts, **self.phases)

    def reset_counts(self) -> None:
        with self._lock:
            self.counts, self.phases = dict.fromkeys(self.counts, 0), dict.fromkeys(PHASES, 0.0)

    def close(self) -> None:
        """Drop the views of the mappings (the table unmaps them once its lookups have finished)."""
        for source in self.sources:
            source.shards = {}
