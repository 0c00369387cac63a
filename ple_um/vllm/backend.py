"""Qwen4ExpPLEMappedEmbedding: vLLM's Qwen4Exp n-gram table served by ple-um from the checkpoint files.

A storage backend beside vLLM's ``Qwen4ExpPLEDeviceEmbedding`` (table in GPU memory) and
``Qwen4ExpPLEPinnedHostEmbedding`` (table copied into pinned host memory). It owns one
``MappedTable``: this rank's vocabulary range ``[org_vocab_start_index, org_vocab_end_index)`` of
the table, mapped read-only from the checkpoint's shard files. It allocates no table memory (its
``weight`` parameter has zero rows, and so has NVFP4's per-row ``weight_scale`` of block scales),
keeps the global scale (FP8 ``weight_scale``, NVFP4 ``weight_scale_2``) exactly as vLLM loads it,
and returns rows in the embedding method's lookup dtype: the storage dtype for FP8 and 16-bit
tables, the layer's ``params_dtype`` for NVFP4, whose rows the lookup decodes (as the stock
``Qwen4ExpPLENvFp4EmbeddingMethod.embedding`` does). The inherited ``dequantize()`` is vLLM's own.

Its forward mirrors the device backend's: gather the ids of the data-parallel ranks that share the
table, look the rows up (zeros outside this rank's range), sum across the embedding-parallel group
(raw FP8 bytes as int8, decoded NVFP4 and 16-bit rows as they are: each row has one owner), select
this rank's tokens. ``lookup_rows`` is the one call that reaches the table.

With ``PLE_UM_OVERLAP`` (the default) it takes vLLM's prefetch hook, as the stock pinned backend
does: the model calls ``start_prefetch`` one decoder layer ahead, which queues the lookup on a side
stream forked from the current one, and ``finalize_prefetch`` joins that stream back and reduces.
Both are plain stream operations, so a FULL CUDA graph captures the fork, the lookup and the join,
and the host gather of the cpu mode (a CUDA host node) runs while the GPU computes the layer
before. In vLLM's breakable piecewise captures an attention op ends the graph segment between the
two, so there the lookup stays on the capture stream, in its segment (a fork left unjoined at a
segment's end is a CUDA error). Only a table whose lookup is not capture-safe (the cpu mode
without its C row copy) runs it in an eager break of a piecewise graph. ROCm's layer has no prefetch
wiring, and there the backend declares no hook (``patch``).

The patched ``Qwen4ExpNGramEmbedding.load_weights`` (``ple_um.vllm.patch``) hands every shard tensor
(for NVFP4 the shards' block scales too) to ``receive_shard`` instead of copying it: a view of a
file on disk is not read; a tensor in memory is compared with the mapped bytes; and ``finish_load``
opens, or after a reload from another checkpoint directory remaps, the table.
"""

from __future__ import annotations

import os
import re

import torch
from vllm.compilation.breakable_cudagraph import (
    BreakableCUDAGraphCapture,
    eager_break_during_capture,
    is_breakable_cudagraph_enabled,
)
from vllm.config import CUDAGraphMode, get_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEEmbeddingMethod,
    Qwen4ExpPLEFp8EmbeddingMethod,
    Qwen4ExpPLENvFp4EmbeddingMethod,
)

from ple_um import MappedTable, envs, open_table
from ple_um.checkpoint import ShardLayout, read_layout
from ple_um.errors import CheckpointError, PleUmError
from ple_um.lookup.streams import own_stream
from ple_um.vllm.source import file_backing, resolve_table_dir

# Under "vllm.": vLLM configures only its own logger tree, so only there do INFO lines reach its log.
logger = init_logger("vllm.ple_um.backend")

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# NVFP4 tables split their block scales into shards like the rows (vLLM's load_weights).
_NVFP4_SHARDED = ("weight", "weight_scale")
_NVFP4_HINT = (
    "an NVFP4 table needs ple_embedding_dtype='nvfp4' in the model's text config (or a ModelOpt "
    "mixed-precision quantization config with NVFP4 for this layer)"
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Rows compared per lookup when a reload delivers a shard from memory.
_COMPARE_ROWS = 1 << 16

_reported = False


class ReloadMismatchError(PleUmError, ValueError):
    """A load delivered shard rows in memory that differ from the mapped checkpoint files."""


def _layer_index(prefix: str) -> int:
    found = _LAYER.findall(prefix)
    if not found:
        raise ValueError(f"cannot find the decoder layer index (layers.<L>.) in the PLE prefix {prefix!r}")
    return int(found[-1])


def _capturing(ids: torch.Tensor) -> bool:
    """Whether this lookup is being captured into a CUDA graph."""
    return ids.is_cuda and torch.cuda.is_current_stream_capturing()


def _segments_end_before_join() -> bool:
    """Whether vLLM is capturing a breakable CUDA graph in a mode other than FULL (its PIECEWISE
    captures): then each attention op ends a graph segment, some between ``start_prefetch`` and
    ``finalize_prefetch`` (the model starts layer L+1's lookup before layer L runs), and a side
    stream forked in one segment and joined in a later one would leave the first capture unjoined,
    a CUDA error. The same test vLLM's ``eager_break_during_capture`` makes."""
    capture = BreakableCUDAGraphCapture.current()
    if capture is None or not capture._capturing:
        return False
    if is_forward_context_available():
        return get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.FULL
    return True


@eager_break_during_capture
def _host_lookup(embedding: Qwen4ExpPLEMappedEmbedding, ids: torch.Tensor, out: torch.Tensor) -> None:
    """The lookup of a table that is not capture-safe (the cpu mode without its C row copy): host
    work that waits for the device, so a piecewise CUDA graph capture runs it in an eager break
    (replayed with the same ``ids`` and ``out`` buffers)."""
    embedding.require_table().lookup(ids, out=out)


class Qwen4ExpPLEMappedEmbedding(Qwen4ExpPLEEmbedding):
    """This rank's rows of a Qwen4Exp PLE table, read from the checkpoint files through ple-um."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype,
        padding_size: int,
        prefix: str,
        embedding_method: Qwen4ExpPLEEmbeddingMethod,
        num_ngram_heads: int = 1,
        max_total_tokens: int = 0,
        data_parallel_rank: int = 0,
        reduce_results: bool = True,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            params_dtype=params_dtype,
            padding_size=padding_size,
            prefix=prefix,
            embedding_method=embedding_method,
            num_ngram_heads=num_ngram_heads,
            max_total_tokens=max_total_tokens,
            data_parallel_rank=data_parallel_rank,
            reduce_results=reduce_results,
        )
        self.layer = _layer_index(prefix)
        # Set by the patched Qwen4ExpNGramEmbedding right after construction.
        self.split_ngram_parts: int | None = None
        vllm_config = get_current_vllm_config()
        self._vllm_config = vllm_config
        # vLLM builds the model under `with target_device:`; the table serves that device.
        self._device = torch.empty(0).device
        load_config = getattr(vllm_config, "load_config", None)
        self._dummy = getattr(load_config, "load_format", None) == "dummy"
        self._table: MappedTable | None = None
        self._table_dir: str | None = None
        self._source_key: tuple | None = None
        self._source_dir: str | None = None
        self._source_files: frozenset[str] = frozenset()
        self._captured = False
        self._captured_zeros = False
        # vLLM's prefetch hook (read by Qwen4ExpNGramEmbedding right after construction): the
        # lookup queued one decoder layer ahead on a side stream.
        self.supports_prefetch = envs.PLE_UM_OVERLAP
        self._prefetch_rows = max_total_tokens * self.etp_data_parallel_size
        self._prefetch_buffer: torch.Tensor | None = None
        self._prefetched: tuple[torch.Tensor, torch.Tensor, bool, int] | None = None
        self._unjoined: list[tuple[torch.Tensor, torch.Tensor, bool, int]] = []
        self._side_stream = None
        # Shard tensors (NVFP4: rows and block scales alike) delivered as file views: not read; and
        # delivered in memory: compared with the mapped bytes.
        self.shards_skipped = 0
        self.shards_compared = 0

    # -- storage ------------------------------------------------------------------------------
    def allocate_embedding_weight(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Zero rows: the table stays in the checkpoint files. The parameter keeps the width and
        dtype the embedding method chose, which the files must have (NVFP4 calls this twice: packed
        rows, uint8 [., D/2], and block scales, E4M3 [., D/16])."""
        del num_embeddings
        return torch.empty((0, embedding_dim), dtype=dtype)

    def _prefetch_out(self, rows: int, ids: torch.Tensor) -> torch.Tensor:
        """The first ``rows`` rows of the prefetch buffer ([rows, heads, head_dim], the lookup
        dtype), allocated at the first (eager) call: vLLM's profile run precedes any capture."""
        buffer = self._prefetch_buffer
        width = (*ids.shape[1:], self.embedding_dim)
        grow = buffer is not None and rows > buffer.shape[0] and tuple(buffer.shape[1:]) == width
        if buffer is None or (grow and not self._captured):
            if ids.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{self.prefix}: the PLE prefetch buffer must be allocated by an eager call of at least "
                    f"{rows} tokens before CUDA graph capture"
                )
            # An eager batch beyond the buffer (vLLM sizes it for max_total_tokens) grows it while
            # no graph has captured a lookup into it (after that the graphs hold its address).
            shape = (max(self._prefetch_rows, rows), *width)
            buffer = self._prefetch_buffer = torch.empty(shape, dtype=self.lookup_dtype, device=ids.device)
        if rows > buffer.shape[0] or tuple(buffer.shape[1:]) != width:
            raise ValueError(
                f"{self.prefix}: the PLE prefetch buffer holds {tuple(buffer.shape)}, but the batch needs "
                f"{(rows, *width)}"
            )
        return buffer[:rows]

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Queue this layer's lookup for ``ngram_ids`` [tokens, heads] on a side stream forked from
        the current one (a FULL graph captures the fork); ``finalize_prefetch`` joins it."""
        if self._prefetched is not None:
            # A start never finalized (a forward that raised in between): its ids stay referenced
            # until the next join, since the side stream may not have read them yet.
            self._unjoined.append(self._prefetched)
        slot_size, _ = self._get_dp_gather_slot(ngram_ids.shape[0])
        ids = self._gather_dp_ids(ngram_ids, slot_size)
        out = self._prefetch_out(ids.shape[0], ids)
        side = False
        if self._table is None and self._dummy:
            self._zero_rows(ids, out)
        elif ids.is_cuda and self.require_table().capture_safe and not _segments_end_before_join():
            if self._side_stream is None:
                self._side_stream = own_stream(ids.device)  # not a torch pool stream
            stream = self._side_stream
            stream.wait_stream(torch.cuda.current_stream(ids.device))
            with torch.cuda.stream(stream):
                self.lookup_rows(ids, out)
            side = True
        else:  # on the current stream: a CPU device, the host path's eager break, or a graph
            self.lookup_rows(ids, out)  # segment that ends before the join (captured into it)
        # ids stay referenced until the join: their memory is not reused while the side stream reads it.
        self._prefetched = (out, ids, side, ngram_ids.shape[0])

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """Join the side stream and return the rows of the last ``start_prefetch``, combined across
        the ranks that share the table: [total_tokens, heads * head_dim]."""
        if self._prefetched is None:
            raise RuntimeError(f"{self.prefix}: finalize_prefetch without a start_prefetch")
        rows, _, side, tokens = self._prefetched
        self._prefetched = None
        if side or any(started[2] for started in self._unjoined):
            torch.cuda.current_stream(rows.device).wait_stream(self._side_stream)
        self._unjoined.clear()
        if total_tokens != tokens:
            raise ValueError(
                f"{self.prefix}: finalize_prefetch for {total_tokens} tokens, but start_prefetch looked up "
                f"{tokens}"
            )
        slot_size, slot_offset = self._get_dp_gather_slot(total_tokens)
        rows = rows[: slot_size * self.etp_data_parallel_size]
        if self.reduce_results and self.tp_size > 1:
            rows = self._reduce(rows)
        return self._select_embeddings(rows, total_tokens, slot_offset).flatten(-2)

    @property
    def table(self) -> MappedTable | None:
        """The open table, or None before weights were loaded."""
        return self._table

    @property
    def owned_rows(self) -> tuple[int, int]:
        """This rank's global row range in the embedding-parallel group."""
        return self.shard_indices.org_vocab_start_index, self.shard_indices.org_vocab_end_index

    @property
    def lookup_dtype(self) -> torch.dtype:
        """The dtype of the rows a lookup returns: the storage dtype, or NVFP4's params_dtype."""
        return self.embedding_method.lookup_dtype(self)

    @property
    def is_nvfp4(self) -> bool:
        return isinstance(self.embedding_method, Qwen4ExpPLENvFp4EmbeddingMethod)

    @property
    def shard_parameters(self) -> tuple[str, ...]:
        """The parameters the checkpoint splits into ``shard_<i>.<name>`` tensors (as stock loads them)."""
        return _NVFP4_SHARDED if self.is_nvfp4 else ("weight",)

    def _parts(self) -> int:
        if self.split_ngram_parts is None:
            raise RuntimeError(f"{self.prefix}: split_ngram_parts was not set (is the vLLM patch applied?)")
        return self.split_ngram_parts

    def _rows_per_shard(self) -> int:
        return -(-self.org_vocab_size // self._parts())

    def _shard_rows(self, index: int) -> int:
        per_shard = self._rows_per_shard()
        return max(0, min(per_shard, self.org_vocab_size - index * per_shard))

    # -- where the table is ---------------------------------------------------------------------
    def _resolved_dir(self) -> str:
        """The directory to map now: PLE_UM_DIR, else the model path or its Hugging Face snapshot.
        Read afresh at each load, since a reload may point vLLM's model config at another path."""
        model_config = getattr(self._vllm_config, "model_config", None)
        load_config = getattr(self._vllm_config, "load_config", None)
        model = getattr(model_config, "model", None)
        revision = getattr(model_config, "revision", None)
        download_dir = getattr(load_config, "download_dir", None)
        key = (envs.PLE_UM_DIR, model, revision, download_dir)
        if key != self._source_key:
            directory = os.path.realpath(resolve_table_dir(model, revision, download_dir))
            files = frozenset(
                os.path.realpath(os.path.join(directory, name))
                for name in os.listdir(directory)
                if name.endswith(".safetensors")
            )
            self._source_key, self._source_dir, self._source_files = key, directory, files
        assert self._source_dir is not None
        return self._source_dir

    def _is_table_file(self, path: str) -> bool:
        """Whether a file vLLM is loading from is one the table is mapped from. With PLE_UM_DIR set,
        the table is explicitly elsewhere, and shard views of the model's own files are not read."""
        if envs.PLE_UM_DIR:
            return True
        self._resolved_dir()
        return os.path.realpath(path) in self._source_files

    # -- loading ------------------------------------------------------------------------------
    def receive_shard(self, index: int, tensor: torch.Tensor, name: str = "weight") -> None:
        """Take checkpoint tensor ``shard_<index>.<name>`` from a load instead of copying it: the rows
        (``name="weight"``) or, for NVFP4, their block scales (``"weight_scale"``).

        A view of a checkpoint file on disk (what vLLM's safetensors iterator yields) is skipped
        without reading its bytes: the table is mapped from those files. A tensor in memory (a
        reload from an iterator, a weight sync) is compared with the bytes this rank maps; a
        difference raises ReloadMismatchError, since the table is read-only.
        """
        parts = self._parts()
        if not 0 <= index < parts:
            raise ValueError(
                f"PLE embedding shard index {index} exceeds split_ngram_parts={parts} ({self.prefix})"
            )
        backing = file_backing(tensor)
        self._check_shard_kind(index, tensor, name, backing)
        rows = self._shard_rows(index)
        width = getattr(self, name).shape[1]  # as stock: the parameter's width
        if tuple(tensor.shape) != (rows, width):
            if tensor.dim() == 2 and tensor.shape[-1] != width:
                what = f"row width {tensor.shape[-1]} != {self._width_meaning(name)}"
            else:
                what = (
                    f"{tensor.shape[0] if tensor.dim() else 0} rows, expected {rows} "
                    f"(ceil({self.org_vocab_size} rows / {parts} parts) per shard)"
                )
            raise ValueError(
                f"Shape mismatch for PLE embedding shard {index}{'' if name == 'weight' else ' ' + name} of "
                f"{self.prefix}: got {tuple(tensor.shape)}, expected {(rows, width)}: {what}"
            )
        if backing is not None and self._is_table_file(backing[0]):
            self.shards_skipped += 1
            return
        self._compare_shard(index, tensor, name)

    def _width_meaning(self, name: str) -> str:
        head_dim = self.embedding_dim
        if not self.is_nvfp4:
            return f"the layer's n-gram head_dim {head_dim}"
        if name == "weight":
            return f"{head_dim // 2}, the packed bytes of the layer's n-gram head_dim {head_dim} (2 a byte)"
        return f"{head_dim // 16}, the block scales of the layer's n-gram head_dim {head_dim} (1 per 16)"

    def _check_shard_kind(
        self, index: int, tensor: torch.Tensor, name: str, backing: tuple[str, int] | None
    ) -> None:
        """The delivered tensor must be of the kind the layer's embedding method loads: an NVFP4
        checkpoint under an FP8 or 16-bit method, or the reverse, fails here naming the cure."""
        where = {"path": backing[0] if backing else None, "tensor": f"ngram_embedding.shard_{index}.{name}"}
        method = type(self.embedding_method).__name__
        if name not in self.shard_parameters:
            raise CheckpointError(
                f"{self.prefix}: the checkpoint splits NVFP4 block scales into shards (shard_<i>.{name}), "
                f"but the layer's {method} serves {self.weight.dtype} rows: {_NVFP4_HINT}",
                **where,
            )
        expected = getattr(self, name).dtype
        if self.is_nvfp4 and tensor.dtype != expected:
            # Stock refuses it too: a cast would silently reinterpret packed E2M1 bytes.
            raise CheckpointError(
                f"{self.prefix}: NVFP4 PLE shard {index} {name} requires {expected}, got {tensor.dtype}: "
                f"the layer's {method} serves NVFP4 (ple_embedding_dtype='nvfp4' or its quantization "
                "config) but the checkpoint's table is not NVFP4: configure the layer for the table's dtype",
                **where,
            )
        if not self.is_nvfp4 and tensor.dtype == torch.uint8:
            raise CheckpointError(
                f"{self.prefix}: shard {index} holds packed NVFP4 rows (uint8), but the layer's {method} "
                f"serves {expected} rows: {_NVFP4_HINT}",
                **where,
            )

    def _compare_shard(self, index: int, tensor: torch.Tensor, name: str = "weight") -> None:
        table = self.ensure_table()
        start = index * self._rows_per_shard()
        row_start, row_end = self.owned_rows
        lo, hi = max(start, row_start), min(start + tensor.shape[0], row_end)
        self.shards_compared += 1
        if lo >= hi:
            return
        if name == "weight":
            spec, stored, what = table.layout.shards[index], table.dtype, ""
        else:  # NVFP4 block scales
            spec, stored, what = table.layout.block_scales[index], torch.float8_e4m3fn, " block scales"
        if tensor.dtype != stored:
            raise ReloadMismatchError(
                f"{self.prefix}: shard {index}{what} was delivered as {tensor.dtype}, but the table in "
                f"{spec.path} ({spec.tensor}) is {stored}; ple-um serves the checkpoint files read-only"
            )
        for a in range(lo, hi, _COMPARE_ROWS):
            b = min(hi, a + _COMPARE_ROWS)
            ids = torch.arange(a, b, device=table.device)
            if table.layout.is_nvfp4:
                mapped = table.lookup_packed(ids)[0 if name == "weight" else 1].view(torch.uint8)
            else:
                mapped = table.lookup(ids).view(torch.uint8)
            given = tensor[a - start : b - start].to(table.device).contiguous().view(torch.uint8)
            if not torch.equal(mapped, given):
                row = a + int((mapped != given).any(dim=1).nonzero()[0])
                raise ReloadMismatchError(
                    f"{self.prefix}: shard {index}{what} delivered in memory differs from the mapped "
                    f"checkpoint at row {row} (file {spec.path}, tensor {spec.tensor}). ple-um serves the "
                    "table read-only from the checkpoint files: write the new table to a checkpoint "
                    "directory and reload from that path, or unset PLE_UM to keep the table in memory"
                )

    def check_headers(self) -> None:
        """Check the headers of the table's files, unless they are open already or not there yet (a
        snapshot vLLM has still to download: finish_load checks it). Called before vLLM's loader
        opens any file, so that a file safetensors would refuse is refused here naming the file,
        which safetensors' own error does not."""
        try:
            directory = self._resolved_dir()
        except CheckpointError:
            return
        if self._table is None or self._table_dir != directory:
            read_layout(directory, self.layer)

    def finish_load(self) -> None:
        """After a load: the table is open (remapped if the checkpoint directory changed) and agrees
        with the layer and with the loaded global scale (FP8 weight_scale, NVFP4 weight_scale_2)."""
        self.ensure_table()
        self.check_scale()

    def ensure_table(self) -> MappedTable:
        """Open this rank's rows of the table, or remap them when the checkpoint directory changed."""
        directory = self._resolved_dir()
        if self._table is not None and self._table_dir == directory:
            return self._table
        if self._captured_zeros:
            raise RuntimeError(
                f"{self.prefix}: CUDA graphs captured this layer's lookup as zero rows (--load-format "
                f"dummy, no table open); opening the table at {directory} now would not change what they "
                "replay. Load the real weights before graph capture (or run with --enforce-eager), or "
                "restart vLLM on the checkpoint"
            )
        if self._table is not None and self._captured:
            raise RuntimeError(
                f"{self.prefix}: the PLE table moved from {self._table_dir} to {directory} after CUDA graphs "
                "captured its lookup; the captured graphs read the old mapping. Restart vLLM on the new "
                "checkpoint"
            )
        # Headers first: a table that does not fit the layer is rejected before anything is mapped
        # or pinned.
        self._check_layout(read_layout(directory, self.layer))
        table = open_table(
            directory, layer=self.layer, rows=self.owned_rows, mode=envs.PLE_UM_MODE, device=self._device
        )
        try:
            if table.device != self._device:
                raise RuntimeError(f"{self.prefix}: the table opened on {table.device}, not {self._device}")
            self._check_cudagraph_mode(table)
        except BaseException:
            table.close()
            raise
        old, self._table, self._table_dir = self._table, table, directory
        if old is not None:
            logger.info("ple-um: %s remapped from %s to %s", self.prefix, old.layout.directory, directory)
            old.close()
        self._report(table)
        return table

    def _check_layout(self, layout: ShardLayout) -> None:
        """The checkpoint's table must be the one this layer was built for."""
        first = layout.shards[0]
        where = {"path": first.path, "tensor": first.tensor}
        if layout.row_dim != self.embedding_dim:
            raise CheckpointError(
                f"{self.prefix}: the table's rows have {layout.row_dim} elements, but the layer's row width "
                f"(n-gram head_dim = ple_embed_dim / n-gram heads) is {self.embedding_dim}",
                **where,
            )
        if layout.num_rows != self.org_vocab_size:
            raise CheckpointError(
                f"{self.prefix}: the table has {layout.num_rows} rows, but the config gives "
                f"{self.org_vocab_size} (the n-gram vocabulary padded to make_ngram_vocab_size_divisible_by)",
                **where,
            )
        if layout.parts != self._parts():
            raise CheckpointError(
                f"{self.prefix}: the table is split into {layout.parts} shards, but the config has "
                f"split_ngram_parts={self._parts()}",
                **where,
            )
        stored = self.weight.dtype  # the storage dtype the embedding method chose
        if layout.is_nvfp4 != self.is_nvfp4 or layout.dtype != stored:
            if layout.is_nvfp4:
                serves, hint = f"{stored} rows", _NVFP4_HINT
            elif self.is_nvfp4:
                serves = "NVFP4 (packed E2M1 rows with E4M3 block scales)"
                hint = (
                    "the layer is NVFP4 (ple_embedding_dtype='nvfp4' or its quantization config) but the "
                    "table is not: point PLE_UM_DIR at the model's NVFP4 table"
                )
            else:
                serves = str(stored)
                hint = (
                    "an FP8 table needs an FP8 quantization config (or ple_embedding_dtype=float8_e4m3fn), "
                    "a 16-bit table the model dtype"
                )
            raise CheckpointError(
                f"{self.prefix}: the table is stored as {layout.dtype_name} ({layout.dtype}), but the "
                f"layer's {type(self.embedding_method).__name__} serves {serves}: {hint}",
                **where,
            )
        if isinstance(self.embedding_method, Qwen4ExpPLEFp8EmbeddingMethod) and layout.scale is None:
            raise CheckpointError(
                f"{self.prefix}: the FP8 table has no ngram_embedding.weight_scale", **where
            )
        if self.is_nvfp4 and layout.scale is None:
            raise CheckpointError(
                f"{self.prefix}: the NVFP4 table has no ngram_embedding.weight_scale_2 (its global scale)",
                **where,
            )
        if self.is_nvfp4 and len(layout.block_scales) != layout.parts:
            raise CheckpointError(
                f"{self.prefix}: the NVFP4 table has block scales (ngram_embedding.shard_<i>.weight_scale) "
                f"for {len(layout.block_scales)} of its {layout.parts} shards",
                **where,
            )

    def _check_cudagraph_mode(self, table: MappedTable) -> None:
        """A lookup that is not capture-safe (the cpu mode without its C row copy: it waits for the
        device) can only live in an eager break of a piecewise graph."""
        if table.capture_safe:
            return
        compilation = getattr(self._vllm_config, "compilation_config", None)
        mode = getattr(compilation, "cudagraph_mode", None)
        if mode is None or mode == CUDAGraphMode.NONE:
            return
        breakable = is_breakable_cudagraph_enabled()
        if breakable and not mode.has_full_cudagraphs():
            return
        why = (
            f"cudagraph_mode={mode.name} captures FULL graphs, where an eager break cannot run"
            if mode.has_full_cudagraphs()
            else f"cudagraph_mode={mode.name} without VLLM_USE_BREAKABLE_CUDAGRAPH=1 has no eager breaks"
        )
        raise RuntimeError(
            f"ple-um serves {self.prefix} in the {table.mode} mode without its host node "
            f"({table.row_reads}): the lookup waits for the device and needs an eager break in the CUDA "
            f"graph; {why}. Make the C row copy available (a working C compiler, PLE_UM_ROWCOPY=1), "
            "or start vLLM with -cc.cudagraph_mode=PIECEWISE and VLLM_USE_BREAKABLE_CUDAGRAPH=1 "
            "(or -cc.cudagraph_mode=NONE), "
            f"or make a GPU mode available (why not: {table.report.reasons})"
        )

    def check_scale(self) -> None:
        """The global scale vLLM loaded (FP8 weight_scale, NVFP4 weight_scale_2) must be the table's
        own (PLE_UM_DIR could name another table)."""
        table = self._table
        name = "weight_scale_2" if self.is_nvfp4 else "weight_scale"
        scale = getattr(self, name, None)
        if table is None or table.scale is None or scale is None or scale.device.type == "meta":
            return
        loaded = scale.detach().float().cpu().reshape(-1)
        if bool((loaded == torch.finfo(torch.float32).min).any()):
            return  # not loaded yet; vLLM's own check reports a scale the checkpoint lacks
        if not torch.equal(loaded, torch.full_like(loaded, table.scale)):
            raise CheckpointError(
                f"{self.prefix}: vLLM loaded {name} {loaded.tolist()} but the mapped table's scale is "
                f"{table.scale}: PLE_UM_DIR names a table that does not belong to this checkpoint",
                path=table.layout.directory,
                tensor=table.layout.scale_tensor,
            )

    def _report(self, table: MappedTable) -> None:
        global _reported
        start, end = table.rows
        layout = table.layout
        row = f"{layout.row_bytes} B per row"
        if layout.is_nvfp4:
            row = f"{layout.row_bytes} B + {layout.row_dim // layout.block_size} B of block scales per row"
        line = "ple-um: %s served from %s in the %s mode: rows [%d, %d) of %d, %s, %s, capture-safe=%s"
        args = (
            self.prefix,
            layout.directory,
            table.mode,
            start,
            end,
            table.num_rows,
            layout.dtype_name,
            row,
            table.capture_safe,
        )
        if _reported:
            logger.debug(line, *args)
            return
        _reported = True
        logger.info(line + "\n%s", *args, table.report.describe())

    def close_table(self) -> None:
        """Release the table's mappings and access resources; idempotent."""
        table, self._table, self._table_dir = self._table, None, None
        if table is not None:
            table.close()

    # -- lookup -------------------------------------------------------------------------------
    def require_table(self) -> MappedTable:
        table = self._table
        if table is None:
            raise RuntimeError(
                f"{self.prefix}: the PLE table is not open: the model's load_weights never ran for this layer"
            )
        return table

    def lookup_rows(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of the global n-gram ``ids`` into ``out`` (``ids.shape + (head_dim,)``, the lookup
        dtype: the storage dtype, or for NVFP4 the layer's params_dtype, decoded as
        ``e2m1 * (block_scale * weight_scale_2)`` in float32 as stock does); zeros for rows outside
        this rank's range. The one call that reads the table.

        Every mode whose table is capture-safe (ats, registered, device, and cpu with its host node):
        stream-ordered work, no host sync, capturable in FULL graphs. The cpu mode without its C row
        copy: host work, run in vLLM's eager break during piecewise graph capture.
        """
        if self._table is None and self._dummy:
            return self._zero_rows(ids, out)
        table = self.require_table()
        if table.capture_safe:
            if _capturing(ids):
                self._captured = True
            table.lookup(ids, out=out)
        else:
            _host_lookup(self, ids, out)
        return out

    def _zero_rows(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``--load-format dummy`` before any table is open: zero rows. A graph that captures this
        fill replays zeros for ever, so a table opened later refuses (``ensure_table``)."""
        if _capturing(ids):
            self._captured_zeros = True
        return out.zero_()

    def _reduce(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Sum the partial rows of the embedding-parallel group (each row has one owner): FP8 as
        int8 bytes, decoded NVFP4 and 16-bit rows as they are, as the stock backends do."""
        if embeddings.dtype in _FP8:
            return self.parallel_group.all_reduce(embeddings.view(torch.int8)).view(embeddings.dtype)
        return self.parallel_group.all_reduce(embeddings)

    def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ngram_ids`` [tokens, heads], combined across the ranks that share the table."""
        slot_size, slot_offset = self._get_dp_gather_slot(ngram_ids.shape[0])
        ids = self._gather_dp_ids(ngram_ids, slot_size)
        rows = torch.empty((*ids.shape, self.embedding_dim), dtype=self.lookup_dtype, device=ids.device)
        self.lookup_rows(ids, rows)
        if self.reduce_results and self.tp_size > 1:
            rows = self._reduce(rows)
        return self._select_embeddings(rows, ngram_ids.shape[0], slot_offset)

    def extra_repr(self) -> str:
        table = self._table
        state = f"{table.mode} mode, {table.layout.directory}" if table is not None else "not open"
        start, end = self.owned_rows
        return f"rows=[{start}, {end}) of {self.org_vocab_size}, row_dim={self.embedding_dim}, {state}"
