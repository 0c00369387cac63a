"""The paths ple-um is measured against, each an honest re-implementation of our own, and one line
for each contender of the bench saying what it is (``describe``):

- ``TorchResident``: the anchor, no ple-um code at all: the table's rows copied into one torch
  tensor in GPU memory (host memory on a machine without a GPU) and gathered by
  ``torch.index_select`` into the caller's preallocated output. What a gather costs when the rows
  are already where the GPU reads fastest, through one stock torch op.
  An Engram table's E8M0 scales are copied beside the rows and decoded by torch ops.
- ``VllmPinnedHost``: the vLLM 0.33 pinned-host way: the whole table copied into torch pinned host
  memory and read by a Triton kernel through its device pointer, one program per row copying bytes.
- ``VllmEngramPinned``: vLLM 0.33's stock storage of a DeepSeek-V4.1 Engram table: rows and scales
  in private pinned host copies, read and decoded by vLLM's own lookup kernel (a stand-in kernel,
  said so, where vLLM is not installed).
- ``SeedsCpuPath`` (the bench's ``seeds cpu``): the gather of the earlier CPU-gather patches
  (``vllm_ple_mmap``, the vLLM patch module docs/OPERATING.md calls the seeds), which keep the table on
  disk behind mmap and gather rows on the CPU: ids to the host, np.unique, a thread pool (32
  workers, chunks of 2048 rows) indexing np.memmap views of the shards, a pinned staging buffer,
  an async H2D copy and the expansion on the GPU.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import triton
import triton.language as tl

from ple_um.checkpoint import ShardLayout
from ple_um.checkpoint.shard_layout import MXFP8
from ple_um.kernels.gather_block_scaled import gather_block_scaled
from ple_um.lookup.decode import decode_mxfp8

VLLM_ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
# The anchor every path's times are divided by: no ple-um code at all (TorchResident).
ANCHOR = "torch index_select"


@triton.jit
def _row_copy_kernel(table_ptr, ids_ptr, out_ptr, row_bytes, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.load(ids_ptr + r).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < row_bytes
    tl.store(out_ptr + r * row_bytes + o, tl.load(table_ptr + i * row_bytes + o, mask=m), mask=m)


class _Address:
    """Lets a Triton kernel take a raw address as a pointer argument of ``dtype``."""

    def __init__(self, addr: int, dtype: torch.dtype = torch.uint8) -> None:
        self.addr, self.dtype = addr, dtype

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


def _device_pointer(host: torch.Tensor, dtype: torch.dtype = torch.uint8) -> _Address:
    """The device address of the pinned host tensor ``host``, as a Triton pointer of ``dtype``."""
    from cuda.bindings import runtime as rt

    err, dptr = rt.cudaHostGetDevicePointer(host.data_ptr(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer: {err}")
    return _Address(int(dptr), dtype)


def _host_copy(layout: ShardLayout, device: torch.device) -> torch.Tensor:
    """The table's raw rows in a private host tensor, pinned where ``device`` is a GPU."""
    host = torch.empty(
        (layout.num_rows, layout.row_bytes), dtype=torch.uint8, pin_memory=device.type == "cuda"
    )
    _copy_rows(layout, host)
    return host


class TorchResident:
    """The anchor: the whole table in one torch tensor on ``device``, rows gathered by
    ``torch.index_select`` into ``out``: one stock kernel, capture-safe. An Engram (MXFP8) table's
    E8M0 scales are gathered the same way and the rows decoded by torch ops into ``out`` (bf16).
    Ids must lie in the table (index_select checks them; the bench draws only such ids)."""

    capture_safe = True

    def __init__(self, layout: ShardLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.rows = torch.empty((layout.num_rows, layout.row_bytes), dtype=torch.uint8, device=device)
        _copy_rows(layout, self.rows)
        self.scales = None
        if layout.is_mxfp8:
            scales = layout.scale_layout()
            self.scales = torch.empty((scales.num_rows, scales.row_bytes), dtype=torch.uint8, device=device)
            _copy_rows(scales, self.scales)

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return torch.index_select(self.rows, 0, ids, out=out)
        decode_mxfp8(self.rows.index_select(0, ids), self.scales.index_select(0, ids), out)
        return out

    def close(self) -> None:
        self.rows = self.scales = None


class VllmPinnedHost:
    """Whole table in pinned host memory (a copy per process), one program per row. vLLM 0.33 runs
    it in an eager break of the CUDA graph (a side-stream prefetch), so it is not captured here."""

    capture_safe = False

    def __init__(self, layout: ShardLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.host = _host_copy(layout, device)
        self.dptr = _device_pointer(self.host)

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rb = self.layout.row_bytes
        _row_copy_kernel[(ids.numel(),)](self.dptr, ids, out, rb, BLOCK=triton.next_power_of_2(rb))
        return out

    def close(self) -> None:
        self.host = None


def vllm_engram_kernel():
    """vLLM 0.33's Engram lookup kernel (``_engram_lookup_kernel``), or None where vLLM (or its
    DeepSeek-V4.1 model) is not installed."""
    try:
        return importlib.import_module(VLLM_ENGRAM_MODULE)._engram_lookup_kernel
    except ImportError:
        return None


class VllmEngramPinned:
    """vLLM 0.33's stock storage of a DeepSeek-V4.1 Engram table (``EngramConfig.cpu_offload``, its
    default): the rows and their E8M0 scales copied into two private pinned host tensors at load,
    read through their device pointers by vLLM's own ``_engram_lookup_kernel`` as
    ``ParallelEngramEmbedding.lookup`` launches it on an H200 (16 rows a program, a grid of at most
    one program per SM, ids unsorted), decoded to bf16. ``kernel`` says whose kernel ran:
    ``"vllm"``, or ``"stand-in"`` where vLLM is not installed (or ``use_vllm`` is False): then
    ple-um's MXFP8 kernel reads the same copies (the same arithmetic, bit for bit), so the figure is
    the storage's, not vLLM's code. Capture-safe, as vLLM captures it. Without CUDA (the Triton
    interpreter) the copies are plain host tensors."""

    capture_safe = True

    def __init__(self, layout: ShardLayout, device: torch.device, use_vllm: bool | None = None) -> None:
        self.layout, self.device = layout, device
        self.vllm = vllm_engram_kernel() if use_vllm is not False else None
        if use_vllm and self.vllm is None:
            raise ImportError(f"{VLLM_ENGRAM_MODULE} is not installed")
        self.kernel = "vllm" if self.vllm is not None else "stand-in"
        self.host = _host_copy(layout, device)
        self.host_scales = _host_copy(layout.scale_layout(), device)
        cuda = device.type == "cuda"
        if cuda:
            self.weight = _device_pointer(self.host, torch.float8_e4m3fn)
            self.scales = _device_pointer(self.host_scales)
            self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.weight, self.scales = self.host.view(torch.float8_e4m3fn), self.host_scales
            self.sms = 1
        bases = [self.weight.data_ptr(), self.scales.data_ptr()]
        self.bases = torch.tensor(bases, dtype=torch.int64, device=device).view(2, 1)
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n, dim = out.shape
        rows = self.layout.num_rows
        if self.vllm is None:
            return gather_block_scaled(
                self.bases[0], self.bases[1], ids, out, self.counters, fmt=MXFP8,
                row_start=0, row_end=rows, num_rows=rows, rows_per_shard=rows, row_dim=dim,
            )  # fmt: skip
        grid = min(triton.cdiv(n, 16), self.sms)
        index = ids.view(n, 1)  # one hash head owning the whole table
        self.vllm[(grid,)](
            self.weight, self.scales, index, index, out, 0, rows, n, 1, 1,
            HEAD_START=0, LOCAL_HEADS=1, TOTAL_HEADS=1, DIM=dim, QUANT_BLOCK=self.layout.block_size,
            BLOCK_R=16, GRID=grid, SORTED=False, PACKED=False, OUT_STRIDE=dim, PEER_ROWS=0,
        )  # fmt: skip
        return out

    def close(self) -> None:
        self.host = self.host_scales = None


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


# The Engram table's pinned-host contender where vLLM's kernel is not installed (VllmEngramPinned).
ENGRAM_STAND_IN = "vllm-like pinned-host (stand-in)"


# What each contender that is not a ple-um mode is, by (name, on an Engram table); ``{memory}``:
# where the anchor's copy lies.
CONTENDER_LINES = {
    (ANCHOR, True): "the anchor, plain torch: the table and its E8M0 scales copied into "
    "torch tensors in {memory}, rows and scales gathered by torch.index_select, decoded to bf16 by torch ops",
    (ANCHOR, False): "the anchor, no ple-um code: the table copied into one torch tensor in "
    "{memory}, rows gathered by torch.index_select",
    ("vllm pinned-host", True): "vLLM 0.33's stock Engram storage (cpu_offload): rows and scales copied "
    "into private pinned host memory (per process), read and decoded by vLLM's own _engram_lookup_kernel",
    (ENGRAM_STAND_IN, True): "a stand-in for vLLM 0.33's stock Engram storage (vLLM is not installed): "
    "rows and scales copied into private pinned host memory, read and decoded by ple-um's MXFP8 kernel",
    ("vllm pinned-host", False): "vLLM 0.33's way: the whole table copied into pinned host memory (per "
    "process), one Triton program per row reading it through the device pointer",
    ("seeds cpu", False): "the seeds: vllm_ple_mmap, the CPU-gather vLLM patch that came before ple-um "
    "(ids to the host, np.unique, 32 threads over np.memmap, pinned staging, an async copy; it "
    "synchronizes the stream, so it is never captured)",
}


def describe(name: str, anchor_memory: str, mxfp8: bool = False) -> str:
    """One line saying what the bench's contender ``name`` is (``mxfp8``: on an Engram table)."""
    line = CONTENDER_LINES.get((name, mxfp8)) or CONTENDER_LINES.get((name, not mxfp8))
    if line is not None:
        return line.format(memory=anchor_memory)
    mode = name.removeprefix("ple-um ").removesuffix(" kernel-only")
    line = f"ple-um's {mode} mode: {MODE_LINES.get(mode, 'an access mode of ple-um')}"
    if name.endswith(" kernel-only"):
        line += "; here with the GPU kernel for every batch size (the host path switched off)"
    return line
