"""ShardLayout: where each row of one PLE layer's table lies in the checkpoint's files, and the
storage formats a table may have.

The Qwen4Exp layout: the table's rows are split into ``split_ngram_parts`` shard tensors; shard
``i`` holds global rows ``[i*S, i*S + rows_i)`` with ``S = ceil(num_rows / parts)``. FP8 tables add
one global scale. NVFP4 tables (vLLM's ``Qwen4ExpPLENvFp4EmbeddingMethod``) store U8 shards
``[rows_i, D/2]`` of packed E2M1 values (two per byte, the even element in the low nibble), next to
each one its E4M3 block scales ``[rows_i, D/NVFP4_BLOCK]``, and one global scale. ``naming`` has
the tensors' names.

A DeepSeek-V4.1 Engram table (``engram``) is one unsplit shard: FP8 E4M3 rows ``[rows, D]`` and,
as its block scales, E8M0 exponent bytes ``[rows, D/MXFP8_BLOCK]`` (the MXFP8 format: a value is
``e4m3 * 2**(e - 127)``), with no global scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ple_um.checkpoint.files import FileIdentity

# Storage dtypes a table may have: safetensors name -> torch dtype.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U8": torch.uint8,  # packed NVFP4: a layout's dtype_name is then "NVFP4"
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
SCALE_DTYPES = ("F32", "BF16", "F16")  # dtypes of a global scale
NVFP4 = "NVFP4"  # dtype_name of an NVFP4 table (U8 shards)
NVFP4_STORAGE = "U8"
NVFP4_BLOCK = 16  # values per E4M3 block scale, as the NVFP4 format defines it
NVFP4_SCALE_DTYPE = "F8_E4M3"
MXFP8 = "MXFP8"  # dtype_name of an Engram table: E4M3 rows with E8M0 block scales
MXFP8_BLOCK = 32  # values per E8M0 block scale
MXFP8_SCALE_DTYPE = "U8"  # E8M0 exponent bytes, mapped as raw bytes


@dataclass(frozen=True)
class ShardSpec:
    """One shard tensor: its rows lie contiguously in ``path`` from byte ``offset``."""

    index: int  # shard index i in the tensor name
    path: str  # absolute path of the safetensors file
    tensor: str  # full tensor name in that file
    offset: int  # absolute byte offset of the shard's row 0 in the file
    rows: int  # rows in this shard (0 for a legal trailing empty shard)
    identity: FileIdentity  # of the file whose header gave this shard: what the mapping must map


@dataclass(frozen=True)
class ShardLayout:
    """A validated table: every shard present, one dtype, one row width, the ceil layout kept."""

    directory: str
    layer: int
    dtype_name: str  # safetensors dtype: F8_E4M3, F8_E5M2, BF16, F16; NVFP4 (U8 shards); MXFP8
    dtype: torch.dtype  # the matching torch dtype (torch.uint8, the packed bytes, for NVFP4)
    row_dim: int  # elements per row (logical values for NVFP4: twice the packed bytes)
    row_bytes: int  # bytes per row (packed: row_dim // 2 for NVFP4)
    num_rows: int  # global rows (sum of shard rows)
    rows_per_shard: int  # S = ceil(num_rows / parts)
    shards: tuple[ShardSpec, ...]  # all parts, in index order
    scale: float | None = None  # the global FP8 scale, or NVFP4's weight_scale_2 (None: no such scale)
    scale_tensor: str | None = None  # its tensor name
    scale_path: str | None = None  # the file that holds it
    # NVFP4 and MXFP8 only: each shard's block scales (NVFP4: E4M3 [rows, row_dim // NVFP4_BLOCK];
    # MXFP8: E8M0 bytes [rows, row_dim // MXFP8_BLOCK]), in the order and with the rows of
    # ``shards``; and the values per block scale. Empty and 0 for other dtypes.
    block_scales: tuple[ShardSpec, ...] = ()
    block_size: int = 0

    @property
    def parts(self) -> int:
        return len(self.shards)

    @property
    def is_nvfp4(self) -> bool:
        return self.dtype_name == NVFP4

    @property
    def is_mxfp8(self) -> bool:
        return self.dtype_name == MXFP8

    @property
    def has_block_scales(self) -> bool:
        """Whether every lookup reads a second table, the block scales, beside the rows."""
        return self.block_size > 0

    def shard_start(self, index: int) -> int:
        return index * self.rows_per_shard

    @property
    def files(self) -> tuple[str, ...]:
        """Every file that holds table data: the shards', and the block scales' too."""
        return tuple(sorted({s.path for s in (*self.shards, *self.block_scales)}))

    @property
    def nbytes(self) -> int:
        """Bytes of table data: rows, plus block scales (NVFP4, MXFP8)."""
        scale_bytes = self.num_rows * (self.row_dim // self.block_size) if self.block_size else 0
        return self.num_rows * self.row_bytes + scale_bytes

    def scale_layout(self) -> ShardLayout:
        """A table's block scales as a table of their own (NVFP4: E4M3; MXFP8: E8M0 bytes, as U8;
        ``row_dim // block_size`` per row), to be mapped like any table; ValueError for other
        dtypes."""
        if not self.has_block_scales:
            raise ValueError(
                f"only NVFP4 and MXFP8 tables have block scales; this table is {self.dtype_name}"
            )
        width = self.row_dim // self.block_size
        scale_dtype = NVFP4_SCALE_DTYPE if self.is_nvfp4 else MXFP8_SCALE_DTYPE
        return ShardLayout(
            directory=self.directory,
            layer=self.layer,
            dtype_name=scale_dtype,
            dtype=STORAGE_DTYPES[scale_dtype],
            row_dim=width,
            row_bytes=width,
            num_rows=self.num_rows,
            rows_per_shard=self.rows_per_shard,
            shards=self.block_scales,
        )
