"""GpuGather: the kernel's view of a table whose rows the device can address.

The ats, registered and device modes differ only in where the per-shard base addresses come from
(the mmap's host addresses, the registration's device pointers, or a device allocation); the
kernel receives them as one int64 tensor and reads rows through them. A block-scaled table (NVFP4,
MXFP8) has a second set of bases, for its block scales. The gather owns its device tensors (bases,
counters, scale) and its launches: none is allocated per call, and after the first call of a kind
the kernel is launched through its compiled handle (``ple_um.kernels.launch``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ple_um.checkpoint import ShardLayout
from ple_um.kernels.gather import _gather_kernel, gather_rows
from ple_um.kernels.gather_block_scaled import _gather_block_scaled_kernel, gather_block_scaled
from ple_um.kernels.launch import DirectLaunch, hooks_set
from ple_um.lookup.counts import path_counts

_BIG = 1 << 31  # batches this big take 64-bit sizes: another compiled kernel
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # a block-scaled table's decoded outputs


class GpuGather:
    """Rows gathered on the device by the Triton kernel; counts every lookup on the device (rows
    looked up, ids outside the table: graph replays too)."""

    def __init__(
        self,
        layout: ShardLayout,
        bases: list[int],
        *,
        device: torch.device,
        row_start: int,
        row_end: int,
        base_align: int,
        scale: torch.Tensor | None,
        scale_bases: list[int] | None = None,
    ) -> None:
        self.layout = layout
        self.device = device
        self.bases = torch.tensor(bases, dtype=torch.int64, device=device)
        # [rows looked up, ids outside the table]; see ple_um/kernels/gather.py.
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)
        self.scale_bases = None
        if scale_bases is not None:
            self.scale_bases = torch.tensor(scale_bases, dtype=torch.int64, device=device)
            self._scratch = torch.zeros(2, dtype=torch.int64, device=device)
        self.row_start, self.row_end = row_start, row_end
        # Where the owned rows lie, as every kernel takes it.
        self._geometry = dict(
            row_start=row_start,
            row_end=row_end,
            num_rows=layout.num_rows,
            rows_per_shard=layout.rows_per_shard,
        )
        self.base_align = base_align
        self.scale = scale
        # One launcher per kernel and per set of fixed arguments (ple_um/kernels/launch.py).
        self._rows = DirectLaunch(_gather_kernel)
        self._block_scales = DirectLaunch(_gather_kernel)
        self._decoded = DirectLaunch(_gather_block_scaled_kernel)
        self.launch = self._rows.why_not or "direct (through the compiled kernel's launcher)"
        # (ids dtype, out dtype, out address mod 8, 64-bit batch) -> a bound launcher (launch.bind)
        self._bound: dict[tuple, object] = {}
        self._index = device.index

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Flat ids (on the device, contiguous) into ``out`` [n, row_dim] (contiguous): raw when out
        has the storage dtype, else dequantized (NVFP4: decoded; raw is the packed bytes, [n,
        row_bytes]). After the first call of a kind the kernel is launched by address (``bind``)."""
        n = ids.numel()
        out_ptr = out.data_ptr()
        key = (ids.dtype, out.dtype, out_ptr & 7, n >= _BIG)
        launch = self._bound.get(key)
        # torch's private call for the current device: torch.cuda.current_device() checks torch's
        # lazy initialization first, host time on every lookup of the bound launcher.
        if launch is not None and torch._C._cuda_getDevice() == self._index and not hooks_set():
            if n:
                launch(ids.data_ptr(), out_ptr, n)
            return out
        return self._gather(ids, out, key)

    def _on_device(self):
        """The table's device made current where another one is: a kernel is launched on the
        current device, and the table's memory is another device's there (its current stream is
        then the one a lookup is queued on, as for a torch op on its tensors)."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self._index:
            return torch.cuda.device(self._index)
        return contextlib.nullcontext()

    def _gather(self, ids: torch.Tensor, out: torch.Tensor, key: tuple) -> torch.Tensor:
        """Triton's launch (the first call of a kind), or a call from another current device."""
        layout = self.layout
        with self._on_device():
            # Decoded rows: DirectLaunch launches them directly after the first call, with no bound launcher.
            if self.scale_bases is not None and out.dtype in _FLOATS:
                # NVFP4 has a global scale (the layout's), MXFP8 none.
                table = dict(
                    self._geometry, row_dim=layout.row_dim, fmt=layout.dtype_name, global_scale=self.scale
                )
                bases = (self.bases, self.scale_bases)
                return gather_block_scaled(*bases, ids, out, self.counters, **table, launch=self._decoded)
            return gather_rows(
                self.bases,
                ids,
                out,
                self.counters,
                storage=layout.dtype,
                **self._geometry,
                row_bytes=layout.row_bytes,
                base_align=self.base_align,
                scale=self.scale if out.dtype != layout.dtype else None,
                launch=self._rows,
                on_bound=functools.partial(self._bound.__setitem__, key),
            )

    def gather_packed(self, ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """NVFP4, MXFP8: the raw rows (uint8 [n, row_bytes]) and block scales (uint8
        [n, row_dim // block_size]) of flat ``ids`` (counted once, by the rows' gather)."""
        with self._on_device():
            self.gather(ids, packed.view(self.layout.dtype))
            gather_rows(
                self.scale_bases,
                ids,
                scales.view(torch.float8_e4m3fn),
                self._scratch,
                storage=torch.float8_e4m3fn,
                **self._geometry,
                row_bytes=scales.shape[1],
                base_align=1,
                launch=self._block_scales,
            )

    def read_counts(self) -> dict:
        """The device counters (a copy to the host on the current stream), as ``path_counts``."""
        rows, out_of_range = (int(v) for v in self.counters.tolist())
        return path_counts(rows, out_of_range)

    def reset_counts(self) -> None:
        self.counters.zero_()
