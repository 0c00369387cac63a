"""SyncGather: the ``cpu`` mode where the C row copy cannot be built (no working C compiler, or
``PLE_UM_ROWCOPY=0``): synchronous, not capture-safe (a lookup waits for the device to read its ids
on the host). The reading itself is ``sync_reader.RowReader``'s.

Wherever the C row copy builds, the host path is ``host.gather.HostGather`` instead: stream-ordered,
no host sync, capture-safe.
"""

from __future__ import annotations

import threading
import time

import torch

from ple_um.lookup.counts import path_counts
from ple_um.lookup.mxfp8 import decode_staged
from ple_um.lookup.sync_reader import RowReader
from ple_um.mapping import MappedShards


class SyncGather:
    """The synchronous host path of the ``cpu`` mode: owns the row readers (the rows, and an NVFP4
    table's block scales), the dequantization and the counting of its lookups (on the host, under a
    lock). Every lookup waits for the device to read its ids: not capture-safe."""

    def __init__(
        self,
        mapping: MappedShards,
        device: torch.device,
        *,
        storage: torch.dtype,
        scale: torch.Tensor | None,
        threads: int,
        chunk: int,
        slots: int,
        why: str,
        scale_mapping: MappedShards | None = None,
    ) -> None:
        self.device = device
        self.storage = storage
        self.scale = scale
        self.num_rows = mapping.layout.num_rows
        self.owned = (mapping.row_start, mapping.row_end)
        self.rows = RowReader(mapping, device, threads=threads, chunk=chunk, slots=slots)
        self.block_scales = (
            RowReader(scale_mapping, device, threads=threads, chunk=chunk, slots=slots)
            if scale_mapping is not None
            else None
        )
        self.row_reads = f"torch.index_select and numpy, synchronous ({why})"
        self.counts = {"rows": 0, "out_of_range": 0, "lookups": 0}
        self.phases = {"dedup": 0.0, "gather": 0.0, "stage": 0.0, "wait": 0.0}
        self.metrics = None  # the table's LookupMetrics, fed at each lookup (set once it serves)
        self._lock = threading.Lock()

    def _classify(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ids as int64, which are owned, how many are outside the table: read on the host)."""
        ids = ids.to(torch.int64)
        in_table = (ids >= 0) & (ids < self.num_rows)
        owned = in_table & (ids >= self.owned[0]) & (ids < self.owned[1])
        return ids, owned, int((~in_table).sum())

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of flat ``ids`` into ``out`` [n, row_dim]: raw when out has the storage dtype (NVFP4:
        the packed bytes), else dequantized or decoded."""
        if out.dtype == self.storage or (self.block_scales is not None and out.dtype == torch.uint8):
            self._read(ids, [out.view(torch.uint8).view(ids.numel(), out.shape[-1] * out.element_size())])
        else:
            decode_staged(self.storage, self._read(ids, [None, None]), self.scale, out)
        return out

    def gather_packed(self, ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """NVFP4: the packed rows and block scales of ``ids`` (uint8)."""
        self._read(ids, [packed, scales])

    def _read(self, ids: torch.Tensor, outs: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """The raw rows of flat ``ids`` (and an NVFP4 table's block scales, as many as ``outs``
        names; None: allocated), counted as one lookup."""
        t0 = time.perf_counter()
        n = ids.numel()
        ids, owned, bad = self._classify(ids)
        readers = [r for r in (self.rows, self.block_scales) if r is not None]
        staged = [reader.gather(ids, owned, out) for reader, out in zip(readers, outs, strict=False)]
        self._count(n, bad, self.rows.last_phases)
        if self.metrics is not None:
            nbytes = n * sum(r.row_bytes for r in readers)
            self.metrics.observe(n, nbytes, bad, self.rows.last_phases, time.perf_counter() - t0)
        return staged

    def _count(self, n: int, bad: int, phases: dict[str, float]) -> None:
        with self._lock:  # lookups from several threads: += is not atomic
            self.counts["rows"] += n
            self.counts["out_of_range"] += bad
            self.counts["lookups"] += 1
            for key, value in phases.items():
                self.phases[key] += value

    def read_counts(self) -> dict:
        """The lookups counted so far, as ``path_counts`` (phases: dedup, gather, stage, wait)."""
        with self._lock:
            return path_counts(**self.counts, **self.phases)

    def reset_counts(self) -> None:
        with self._lock:
            for key in self.counts:
                self.counts[key] = 0
            for key in self.phases:
                self.phases[key] = 0.0

    def close(self) -> None:
        for reader in (self.block_scales, self.rows):
            if reader is not None:
                reader.close()
