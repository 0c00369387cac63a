"""The paths ple-um is measured against, each an honest re-implementation of our own, and one line
for each contender of the bench saying what it is (``describe``):

- ``TorchResident``: the anchor, no ple-um code at all: the table's rows copied into one torch
  tensor in GPU memory (host memory on a machine without a GPU) and gathered by
  ``torch.index_select`` into the caller's preallocated output. What a gather costs when the rows
  are already where the GPU reads fastest, through one stock torch op.
- ``VllmPinnedHost``: the vLLM 0.33 pinned-host way: the whole table copied into torch pinned host
  memory and read by a Triton kernel through its device pointer, one program per row copying bytes.
- ``SeedsCpuPath`` (the bench's ``seeds cpu``): the gather of the earlier CPU-gather patches
  (``vllm_ple_mmap``, the vLLM patch module the README calls the seeds), which keep the table on
  disk behind mmap and gather rows on the CPU: ids to the host, np.unique, a thread pool (32
  workers, chunks of 2048 rows) indexing np.memmap views of the shards, a pinned staging buffer,
  an async H2D copy and the expansion on the GPU.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import triton
import triton.language as tl

from ple_um.checkpoint import ShardLayout


@triton.jit
def _row_copy_kernel(table_ptr, ids_ptr, out_ptr, row_bytes, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.load(ids_ptr + r).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < row_bytes
    tl.store(out_ptr + r * row_bytes + o, tl.load(table_ptr + i * row_bytes + o, mask=m), mask=m)


class _Address:
    """Lets a Triton kernel take a raw address as a uint8 pointer argument."""

    dtype = torch.uint8

    def __init__(self, addr: int) -> None:
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


def _copy_rows(layout: ShardLayout, dst: torch.Tensor, chunk_bytes: int = 64 << 20) -> None:
    """Every row of the table, in order, into ``dst`` ([num_rows, row_bytes] uint8, on any device),
    read from the shard files a chunk at a time."""
    rb = layout.row_bytes
    step = max(1, chunk_bytes // rb)
    pos = 0
    for spec in layout.shards:
        if not spec.rows:
            continue
        mm = np.memmap(spec.path, dtype=np.uint8, mode="r", offset=spec.offset, shape=(spec.rows, rb))
        for a in range(0, spec.rows, step):
            b = min(a + step, spec.rows)
            if dst.device.type == "cpu":
                dst[pos + a : pos + b].numpy()[:] = mm[a:b]
            else:  # a writable copy of the chunk for torch, then one host-to-device copy
                dst[pos + a : pos + b].copy_(torch.from_numpy(np.array(mm[a:b])))
        pos += spec.rows
        del mm


class TorchResident:
    """The anchor: the whole table in one torch tensor on ``device``, rows gathered by
    ``torch.index_select`` into ``out``: one stock kernel, capture-safe. Ids must lie in the table
    (index_select checks them; the bench draws only such ids)."""

    capture_safe = True

    def __init__(self, layout: ShardLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.rows = torch.empty((layout.num_rows, layout.row_bytes), dtype=torch.uint8, device=device)
        _copy_rows(layout, self.rows)

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.rows, 0, ids, out=out)

    def close(self) -> None:
        self.rows = None


class VllmPinnedHost:
    """Whole table in pinned host memory (a copy per process), one program per row. vLLM 0.33 runs
    it in an eager break of the CUDA graph (a side-stream prefetch), so it is not captured here."""

    capture_safe = False

    def __init__(self, layout: ShardLayout, device: torch.device) -> None:
        from cuda.bindings import runtime as rt

        self.layout = layout
        self.device = device
        self.host = torch.empty((layout.num_rows, layout.row_bytes), dtype=torch.uint8, pin_memory=True)
        _copy_rows(layout, self.host)
        err, dptr = rt.cudaHostGetDevicePointer(self.host.data_ptr(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostGetDevicePointer: {err}")
        self.dptr = _Address(int(dptr))

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rb = self.layout.row_bytes
        _row_copy_kernel[(ids.numel(),)](self.dptr, ids, out, rb, BLOCK=triton.next_power_of_2(rb))
        return out

    def close(self) -> None:
        self.host = None


class SeedsCpuPath:
    """The CPU gather of the earlier CPU-gather patches (vllm_ple_mmap), as they run it (32 workers,
    chunks of 2048 rows). It synchronizes with the GPU to read the ids: never capture-safe."""

    capture_safe = False

    def __init__(
        self, layout: ShardLayout, device: torch.device, workers: int = 32, chunk: int = 2048
    ) -> None:
        self.layout = layout
        self.device = device
        self.chunk = chunk
        self.mm = [
            np.memmap(s.path, dtype=np.uint8, mode="r", offset=s.offset, shape=(s.rows, layout.row_bytes))
            if s.rows
            else None
            for s in layout.shards
        ]
        for m in self.mm:
            if m is not None:
                m._mmap.madvise(1)  # MADV_RANDOM, as vllm_ple_mmap does
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.pinned: torch.Tensor | None = None

    def _gather(self, uniq: np.ndarray) -> np.ndarray:
        S = self.layout.rows_per_shard
        shard = uniq // S
        local = uniq - shard * S
        out = np.empty((uniq.size, self.layout.row_bytes), dtype=np.uint8)
        bounds = np.flatnonzero(np.diff(shard)) + 1
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [uniq.size]))
        tasks = [
            (int(shard[s]), c, min(c + self.chunk, e))
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
            for c in range(s, e, self.chunk)
        ]

        def run(t):
            si, a, b = t
            out[a:b] = self.mm[si][local[a:b]]

        if len(tasks) == 1:
            run(tasks[0])
        else:
            list(self.pool.map(run, tasks))
        return out

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if ids.device.type == "cuda":
            torch.cuda.current_stream(ids.device).synchronize()
        ids_np = ids.detach().to("cpu").numpy().reshape(-1)
        uniq, inverse = np.unique(ids_np, return_inverse=True)
        rows = self._gather(uniq)
        if self.device.type == "cuda":
            if self.pinned is None or self.pinned.shape[0] < rows.shape[0]:
                self.pinned = torch.empty(
                    (max(rows.shape[0], 4096), rows.shape[1]), dtype=torch.uint8, pin_memory=True
                )
            buf = self.pinned[: rows.shape[0]]
            buf.numpy()[:] = rows
            dev = buf.to(self.device, non_blocking=True)
        else:
            dev = torch.from_numpy(rows)
        inv = torch.from_numpy(inverse.reshape(-1)).to(self.device, non_blocking=True)
        torch.index_select(dev, 0, inv, out=out)
        return out

    def close(self) -> None:
        self.pool.shutdown()
        self.mm = []


# What each ple-um mode's lookup does, in the bench's words (README's "Access modes" in full).
MODE_LINES = {
    "ats": "the GPU kernel reads the mmap's host addresses directly (ATS or HMM); big batches may take "
    "the host path",
    "registered": "the GPU kernel reads the mapping through its read-only cudaHostRegister device "
    "pointer; big batches may take the host path",
    "cpu": "the host path: C code copies the rows from the mmap into pinned staging as stream-ordered "
    "work, then one copy into the output",
    "device": "the owned rows copied into GPU memory at open, gathered by the GPU kernel",
}


def describe(name: str, anchor_memory: str) -> str:
    """One line saying what the bench's contender ``name`` is."""
    if name == "torch index_select":
        return (
            f"the anchor, no ple-um code: the table copied into one torch tensor in {anchor_memory}, "
            "rows gathered by torch.index_select"
        )
    if name == "vllm pinned-host":
        return (
            "vLLM 0.33's way: the whole table copied into pinned host memory (per process), one Triton "
            "program per row reading it through the device pointer"
        )
    if name == "seeds cpu":
        return (
            "the seeds: vllm_ple_mmap, the CPU-gather vLLM patch that came before ple-um (ids to the host, "
            "np.unique, 32 threads over np.memmap, pinned staging, an async copy; it synchronizes the "
            "stream, so it is never captured)"
        )
    mode = name.removeprefix("ple-um ").removesuffix(" kernel-only")
    line = f"ple-um's {mode} mode: {MODE_LINES.get(mode, 'an access mode of ple-um')}"
    if name.endswith(" kernel-only"):
        line += "; here with the GPU kernel for every batch size (the host path switched off)"
    return line
