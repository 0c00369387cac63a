"""Qwen4ExpPLEMappedEmbedding: vLLM's Qwen4Exp n-gram table served by ple-um from the checkpoint files.

A storage backend beside vLLM's ``Qwen4ExpPLEDeviceEmbedding`` (table in GPU memory) and
``Qwen4ExpPLEPinnedHostEmbedding`` (table copied into pinned host memory). It owns one
``MappedTable``: this rank's vocabulary range ``[org_vocab_start_index, org_vocab_end_index)`` of
the table, mapped read-only from the checkpoint's shard files. It allocates no table memory (its
``weight`` parameter has zero rows, and so has NVFP4's per-row ``weight_scale`` of block scales),
keeps the global scale (FP8 ``weight_scale``, NVFP4 ``weight_scale_2``) exactly as vLLM loads it,
and returns rows in the embedding method's lookup dtype: the storage dtype for FP8 and 16-bit
tables (a 16-bit table under another model dtype converted to it, as stock's loader casts it:
``loading.converts_rows``), the layer's ``params_dtype`` for NVFP4, whose rows the lookup decodes
(as the stock ``Qwen4ExpPLENvFp4EmbeddingMethod.embedding`` does). The inherited ``dequantize()``
is vLLM's own.

Its forward mirrors the device backend's: gather the ids of the data-parallel ranks that share the
table, look the rows up (zeros outside this rank's range), sum across the embedding-parallel group
(raw FP8 bytes as int8, decoded NVFP4 and 16-bit rows as they are: each row has one owner), select
this rank's tokens. ``lookup_rows`` is the one call that reaches the table.

With ``PLE_UM_OVERLAP`` (the default) it takes vLLM's prefetch hook, as the stock pinned backend
does: the model calls ``start_prefetch`` one decoder layer ahead, which queues the lookup on a side
stream forked from the current one, and ``finalize_prefetch`` joins that stream back and reduces
(``prefetch``). Both are plain stream operations, so a FULL CUDA graph captures the fork, the
lookup and the join, and the host gather of the cpu mode (a CUDA host node) runs while the GPU
computes the layer before. Where the lookup may fork, and where it runs in an eager break, are
vLLM's CUDA-graph rules, at the end of this file: the side stream is forked in eager calls and FULL
captures, never in vLLM's breakable piecewise captures, where an attention op ends a graph segment
between ``start_prefetch`` and ``finalize_prefetch`` (``segments_end_before_join``); a table that is
not capture-safe is looked up in an eager break of a piecewise capture (``host_lookup``), and refused
at load under a graph mode without eager breaks (``check_cudagraph_mode``). What a capture fixes for
good (a lookup of the open table, the zero rows of ``--load-format dummy``) the layer's
``ServedTable`` and ``zeros_captured`` note, and refuse the opens that would leave the graphs
replaying stale work. Once the model is loaded its ple-um layers are linked (``early``): the step's
first PLE layer's ``start_prefetch`` then queues every PLE layer's lookup at once
(``PLE_UM_EARLY_LOOKUPS``), each into its layer's own prefetch buffer, each joined by its layer.
ROCm's layer has no prefetch wiring, and there the backend declares no hook (``patch``).

The patched ``Qwen4ExpNGramEmbedding.load_weights`` (``patch``) hands every shard tensor (for NVFP4
the shards' block scales too) to ``receive_shard`` instead of copying it: a view of a file on disk
is not read; a tensor in memory is compared with the mapped bytes (``loading``); and
``finish_load`` opens, or after a reload from another checkpoint directory remaps, the table
(found by ``source``).
"""

from __future__ import annotations

from collections.abc import Callable

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
    Qwen4ExpPLENvFp4EmbeddingMethod,
)

from ple_um import MappedTable, delivered, envs
from ple_um.checkpoint import read_layout
from ple_um.delivered import ReloadMismatchError
from ple_um.errors import CheckpointError
from ple_um.served import (
    ServedLayer,
    ServedTable,
    capturing,
    host_lookup_refused,
    layer_index,
)
from ple_um.vllm import loading
from ple_um.vllm.overlap import OverlappedLookups, queue_lookups
from ple_um.vllm.source import TableSource, file_backing

__all__ = ["Qwen4ExpPLEMappedEmbedding", "ReloadMismatchError"]

# Under "vllm.": vLLM configures only its own logger tree, so only there do INFO lines reach its log.
logger = init_logger("vllm.ple_um.backend")

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class Qwen4ExpPLEMappedEmbedding(ServedLayer, Qwen4ExpPLEEmbedding):
    """This rank's rows of a Qwen4Exp PLE table, read from the checkpoint files through ple-um."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, prefix: str, max_total_tokens: int = 0, **kwargs
    ) -> None:
        """vLLM's ``Qwen4ExpPLEEmbedding`` constructor, its keyword arguments passed on as vLLM's backend
        selection gives them (params_dtype, padding_size, embedding_method, num_ngram_heads,
        data_parallel_rank, reduce_results)."""
        super().__init__(
            num_embeddings, embedding_dim, prefix=prefix, max_total_tokens=max_total_tokens, **kwargs
        )
        self.layer = layer_index(prefix)
        # Set by the patched Qwen4ExpNGramEmbedding right after construction.
        self.split_ngram_parts: int | None = None
        vllm_config = get_current_vllm_config()
        self._vllm_config = vllm_config
        # vLLM builds the model under `with target_device:`; the table serves that device.
        self._device = torch.empty(0).device
        load_config = getattr(vllm_config, "load_config", None)
        self._dummy = getattr(load_config, "load_format", None) == "dummy"
        self.served = ServedTable(logger, "vLLM")
        self.source = TableSource(vllm_config)
        # A CUDA graph captured the zero rows of ``--load-format dummy`` (no table open), which it
        # replays for ever: a table opened later is refused.
        self.zeros_captured = False
        # vLLM's prefetch hook (read by Qwen4ExpNGramEmbedding right after construction): the
        # lookup queued one decoder layer ahead on a side stream.
        self.supports_prefetch = envs.PLE_UM_OVERLAP
        self.overlapped = OverlappedLookups(
            prefix, max_total_tokens * self.etp_data_parallel_size, embedding_dim
        )
        # The model's ple-um layers whose lookups of a step start together (``early.link_model``).
        self.early = None
        # Shard tensors (NVFP4: rows and block scales alike) delivered as file views: not read (those
        # delivered in memory are ``shards_compared``).
        self.shards_skipped = 0
        # Set while the model's load_weights runs (``patch``): it finishes the load, once, at its end.
        self.in_model_load = False

    def allocate_embedding_weight(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Zero rows: the table stays in the checkpoint files. The parameter keeps the width and
        dtype the embedding method chose, which the files must have (NVFP4 calls this twice: packed
        rows, uint8 [., D/2], and block scales, E4M3 [., D/16])."""
        del num_embeddings
        return torch.empty((0, embedding_dim), dtype=dtype)

    # -- what the layer is ----------------------------------------------------------------------
    @property
    def lookup_dtype(self) -> torch.dtype:
        """The dtype of the rows a lookup returns: the parameter's (the storage dtype, or the model
        dtype a 16-bit table is converted to), or NVFP4's params_dtype."""
        return self.embedding_method.lookup_dtype(self)

    def delivered_cast(self, table: MappedTable) -> torch.dtype:
        """Stock vLLM copies an FP8 or 16-bit shard into its table cast to the table's dtype, the
        parameter's (``PLEVocabParallelEmbedding._copy_embedding_shard_``): rows delivered in memory
        are compared after the same cast. NVFP4 shards of another dtype stock refuses, as here."""
        del table
        return self.weight.dtype

    @property
    def is_nvfp4(self) -> bool:
        return isinstance(self.embedding_method, Qwen4ExpPLENvFp4EmbeddingMethod)

    # -- loading ------------------------------------------------------------------------------
    def receive_shard(self, index: int, tensor: torch.Tensor, name: str = "weight") -> None:
        """Take checkpoint tensor ``shard_<index>.<name>`` from a load instead of copying it: the rows
        (``name="weight"``) or, for NVFP4, their block scales (``"weight_scale"``).

        A view of a checkpoint file on disk (what vLLM's safetensors iterator yields) is skipped
        without reading its bytes: the table is mapped from those files. A tensor in memory (a
        reload from an iterator, a weight sync) is compared with the bytes this rank maps; a
        difference raises ReloadMismatchError, since the table is read-only.
        """
        backing = file_backing(tensor)
        loading.check_shard(self, index, tensor, name, backing)
        if backing is not None and self.source.is_table_file(backing[0]):
            self.shards_skipped += 1
            self.deliveries().note_files()  # a load from the files: it brings the whole table
            return
        self.compare_delivered(index, tensor, name)

    def check_headers(self) -> None:
        """Check the headers of the table's files, unless they are open already or not there yet (a
        Hugging Face snapshot vLLM has still to download, or to finish downloading, in its weight
        iterator: finish_load checks it). Called before vLLM's loader opens any file, so that a
        file safetensors would refuse is refused here naming the file, which safetensors' own
        error does not."""
        try:
            directory = self.source.directory()
            pending = self.source.awaits_download()
        except CheckpointError:
            return
        if not pending and self.served.open_at(directory) is None:
            read_layout(directory, self.layer)

    def finish_load(self) -> None:
        """After a load: the table is open (remapped if the checkpoint directory changed) and agrees
        with the layer and with the loaded global scale (FP8 weight_scale, NVFP4 weight_scale_2).

        A new table stays staged until that check passes, and while a weight sync has delivered only
        part of it (``delivered.finish_load``): a load that fails the check closes the new table and
        leaves the old one serving, with the global scale it was served with restored (vLLM had
        already copied the refused one into the layer's parameter)."""
        delivered.finish_load(self)

    def global_scale(self) -> tuple[str, torch.Tensor | None, Callable[[MappedTable], float | None]]:
        """FP8 weight_scale or NVFP4 weight_scale_2, which must be the table's scale. One vLLM has not
        loaded yet (on the meta device, or its sentinel) is None: left to vLLM's own check, which
        reports a scale the checkpoint lacks."""
        scale = getattr(self, self.scale_name, None)
        if scale is not None and (
            scale.device.type == "meta"
            or bool((scale.detach().float() == torch.finfo(torch.float32).min).any())
        ):
            scale = None
        return self.scale_name, scale, lambda table: table.scale

    @property
    def scale_name(self) -> str:
        """The layer's global scale parameter: NVFP4's weight_scale_2, else the FP8 weight_scale."""
        return "weight_scale_2" if self.is_nvfp4 else "weight_scale"

    def ensure_table(self) -> MappedTable:
        """This rank's rows of the table: the serving ones, or those of a new checkpoint directory (or
        of replaced files) opened and staged, to serve once ``finish_load`` has checked them."""
        directory = self.source.directory()

        def fits() -> None:
            if self.zeros_captured:
                raise RuntimeError(
                    f"{self.prefix}: CUDA graphs captured this layer's lookup as zero rows (--load-format "
                    f"dummy, no table open); opening the table at {directory} now would not change what "
                    "they replay. Load the real weights before graph capture (or run with --enforce-eager), "
                    "or restart vLLM on the checkpoint"
                )
            # A table that does not fit the layer is rejected before anything is mapped or pinned.
            loading.check_layout(self, read_layout(directory, self.layer))

        def check(table: MappedTable) -> None:
            if table.device != self._device:
                raise RuntimeError(f"{self.prefix}: the table opened on {table.device}, not {self._device}")
            check_cudagraph_mode(self.prefix, table, self._vllm_config)

        return self.serve_table(directory, self._device, fits=fits, check=check, stage=True)

    # -- lookup -------------------------------------------------------------------------------
    def lookup_rows(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of the global n-gram ``ids`` into ``out`` (``ids.shape + (head_dim,)``, the lookup
        dtype: the storage dtype, or for NVFP4 the layer's params_dtype, decoded as
        ``e2m1 * (block_scale * weight_scale_2)`` in float32 as stock does); zeros for rows outside
        this rank's range. The one call that reads the table.

        Every mode whose table is capture-safe (ats, registered, device, and cpu with its host node):
        stream-ordered work, no host sync, capturable in FULL graphs. The cpu mode without its C row
        copy: host work, run in vLLM's eager break during piecewise graph capture.
        """
        if self.served.table is None and self._dummy:
            return self._zero_rows(ids, out)
        table = self.require_table()
        if table.capture_safe:
            self.served.note_lookup(ids)
            table.lookup(ids, out=out)
        else:
            host_lookup(self, ids, out)
        return out

    def _zero_rows(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``--load-format dummy`` before any table is open: zero rows. A graph that captures this
        fill replays zeros for ever, so a table opened later refuses (``ensure_table``)."""
        self.zeros_captured = self.zeros_captured or capturing(ids)
        return out.zero_()

    def _combine(self, rows: torch.Tensor, tokens: int, slot_offset: int) -> torch.Tensor:
        """This rank's ``tokens`` rows of ``rows`` (the lookup of the data-parallel ranks' gathered
        ids), summed across the embedding-parallel group when ``reduce_results`` (each row has one
        owner): FP8 as int8 bytes, decoded NVFP4 and 16-bit rows as they are, as the stock backends do."""
        if self.reduce_results and self.tp_size > 1:
            if rows.dtype in _FP8:
                rows = self.parallel_group.all_reduce(rows.view(torch.int8)).view(rows.dtype)
            else:
                rows = self.parallel_group.all_reduce(rows)
        return self._select_embeddings(rows, tokens, slot_offset)

    def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ngram_ids`` [tokens, heads], combined across the ranks that share the table."""
        slot_size, slot_offset = self._get_dp_gather_slot(ngram_ids.shape[0])
        ids = self._gather_dp_ids(ngram_ids, slot_size)
        rows = torch.empty((*ids.shape, self.embedding_dim), dtype=self.lookup_dtype, device=ids.device)
        self.lookup_rows(ids, rows)
        return self._combine(rows, ngram_ids.shape[0], slot_offset)

    # -- vLLM's prefetch hook -------------------------------------------------------------------
    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Queue this layer's lookup for ``ngram_ids`` [tokens, heads] on a side stream forked from
        the current one where ``may_fork`` allows (a FULL graph captures the fork), else on the
        current stream; ``finalize_prefetch`` joins it."""
        ids, out = self.prepare_lookup(ngram_ids)
        queue_lookups(self.overlapped.side, [(self, ids, out, ngram_ids.shape[0])], self.may_fork(ids))

    def prepare_lookup(self, ngram_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A new overlapped lookup of ``ngram_ids`` [tokens, heads]: the ids of the data-parallel ranks that
        share the table (gathered on the current stream) and the prefetch buffer's rows for them."""
        self.overlapped.begin()
        slot_size, _ = self._get_dp_gather_slot(ngram_ids.shape[0])
        ids = self._gather_dp_ids(ngram_ids, slot_size)
        return ids, self.overlapped.out(ids.shape[0], ids, self.lookup_dtype, fixed=self.served.captured)

    def may_fork(self, ids: torch.Tensor) -> bool:
        """Whether this layer's lookup of ``ids`` may be queued on a side stream: on a CUDA device, for
        a capture-safe table (the zero rows of a dummy load are), outside a graph segment that ends
        before the join (``segments_end_before_join``). Otherwise the lookup runs on the
        current stream (a CPU device; the host path's eager break; a segment that ends before the
        join, which captures the lookup into it)."""
        safe = (self.served.table is None and self._dummy) or self.require_table().capture_safe
        return ids.is_cuda and safe and not segments_end_before_join()

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """Join the side stream and return the rows of the last ``start_prefetch``, combined across
        the ranks that share the table: [total_tokens, heads * head_dim], a tensor of the caller's
        own, as stock's pinned backend returns (the prefetch buffer, and an in-place all-reduce's
        result in it, are the next start_prefetch's to overwrite)."""
        rows = self.overlapped.join(total_tokens)
        slot_size, slot_offset = self._get_dp_gather_slot(total_tokens)
        rows = self._combine(rows[: slot_size * self.etp_data_parallel_size], total_tokens, slot_offset)
        rows = rows.flatten(-2)
        out = rows.new_empty(rows.shape)
        out.copy_(rows)
        return out


# -- vLLM's CUDA-graph rules: where a lookup may run while vLLM captures graphs ------------------
def segments_end_before_join() -> bool:
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
def host_lookup(embedding: Qwen4ExpPLEMappedEmbedding, ids: torch.Tensor, out: torch.Tensor) -> None:
    """The lookup of a table that is not capture-safe (the cpu mode without its C row copy): host
    work that waits for the device, so a piecewise CUDA graph capture runs it in an eager break
    (replayed with the same ``ids`` and ``out`` buffers)."""
    embedding.require_table().lookup(ids, out=out)


def check_cudagraph_mode(prefix: str, table: MappedTable, vllm_config) -> None:
    """A lookup that is not capture-safe (the cpu mode without its C row copy: it waits for the
    device) can only live in an eager break of a piecewise graph: RuntimeError under any other
    graph mode vLLM is configured for."""
    if table.capture_safe:
        return
    compilation = getattr(vllm_config, "compilation_config", None)
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
    raise host_lookup_refused(
        prefix,
        table,
        f"it needs an eager break in the CUDA graph; {why}",
        "or start vLLM with -cc.cudagraph_mode=PIECEWISE and VLLM_USE_BREAKABLE_CUDAGRAPH=1 "
        "(or -cc.cudagraph_mode=NONE)",
    )
