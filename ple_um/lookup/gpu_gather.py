"""GpuGather: the kernel's view of a table whose rows the device can address.

The ats, registered and device modes differ only in where the per-shard base addresses come from
(the mmap's host addresses, the registration's device pointers, or a device allocation); the
kernel receives them as one int64 tensor and reads rows through them. An NVFP4 table has a second
set of bases, for its block scales.
"""

from __future__ import annotations

import torch

from ple_um.checkpoint import ShardLayout
from ple_um.kernels import gather_nvfp4, gather_rows


class GpuGather:
    """Holds the device tensors a lookup needs (bases, counters, scale): none is allocated per call."""

    def __init__(
        self,
        layout: ShardLayout,
        bases: list[int],
        *,
        device: torch.device,
        row_start: int,
        row_end: int,
        base_align: int,
        counters: torch.Tensor,
        scale: torch.Tensor | None,
        scale_bases: list[int] | None = None,
    ) -> None:
        self.layout = layout
        self.bases = torch.tensor(bases, dtype=torch.int64, device=device)
        self.scale_bases = None
        if scale_bases is not None:
            self.scale_bases = torch.tensor(scale_bases, dtype=torch.int64, device=device)
            self._scratch = torch.zeros(2, dtype=torch.int64, device=device)
        self.row_start, self.row_end = row_start, row_end
        self.base_align = base_align
        self.counters = counters
        self.scale = scale

    def gather(self, ids: torch.Tensor, out: torch.Tensor, **launch) -> torch.Tensor:
        """Flat ids (on the device) into ``out`` [n, row_dim]: raw when out has the storage dtype,
        else dequantized (NVFP4: decoded; raw is the packed bytes, [n, row_bytes]). ``launch``:
        the kernel's program shape (``rows_per_program``, ``num_warps``), for measurements."""
        layout = self.layout
        if self.scale_bases is not None and out.dtype != layout.dtype:
            return gather_nvfp4(
                self.bases,
                self.scale_bases,
                ids,
                out,
                self.counters,
                self.scale,
                row_start=self.row_start,
                row_end=self.row_end,
                num_rows=layout.num_rows,
                rows_per_shard=layout.rows_per_shard,
                row_dim=layout.row_dim,
                **launch,
            )
        return gather_rows(
            self.bases,
            ids,
            out,
            self.counters,
            storage=layout.dtype,
            row_start=self.row_start,
            row_end=self.row_end,
            num_rows=layout.num_rows,
            rows_per_shard=layout.rows_per_shard,
            row_bytes=layout.row_bytes,
            base_align=self.base_align,
            scale=self.scale if out.dtype != layout.dtype else None,
            **launch,
        )

    def gather_block_scales(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """NVFP4: the raw E4M3 block scales of flat ``ids`` into ``out`` [n, row_dim // 16] (not
        counted: the rows' gather counts the lookup)."""
        return gather_rows(
            self.scale_bases,
            ids,
            out,
            self._scratch,
            storage=torch.float8_e4m3fn,
            row_start=self.row_start,
            row_end=self.row_end,
            num_rows=self.layout.num_rows,
            rows_per_shard=self.layout.rows_per_shard,
            row_bytes=out.shape[1],
            base_align=1,
        )
