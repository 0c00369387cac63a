"""PleUmHostEmbedding: SGLang's offloaded Qwen4Exp n-gram table, served by ple-um from the checkpoint.

SGLang 0.5.23 builds a PLE layer's n-gram embedding on the meta device and, when
``ple_offload_embedding`` is on, wraps it in ``Qwen4ExpPinnedHostEmbedding``, which copies the table
into pinned host memory (or rewrites it into a file of its own). The plugin replaces that class by
this subclass and turns the offload on for every PLE layer built under PLE_UM=1 (``plugin``).

It keeps the surface SGLang's PLE layer calls. ``allocate_output`` and ``reduce`` are the stock
ones (bf16 rows; the tensor-parallel all-reduce, or the attention-TP one under
``SGLANG_USE_ATTN_TP_NGRAM``), ``forward`` is ``reduce(gather(ids))``, and the layer's
``start_prefetch`` calls ``gather`` on its side stream into its own (CUDA-graph) buffers. ``gather``
reads this rank's rows ``[org_vocab_start_index, org_vocab_end_index)`` through one ``MappedTable``
(zeros for every other id, in the table or not), and emits bf16 rows as the stock gather does: FP8
and 16-bit rows converted by torch without their scale (the model multiplies by ``weight_scale``
after the reduce, as stock), NVFP4 rows decoded by ple-um (``weight_scale`` stays 1 there). The
lookup is stream-ordered work in every capture-safe mode: no host synchronisation, so a CUDA graph
captures it.

The parameter ``weight`` has zero rows: the table stays in the checkpoint's files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod
from sglang.srt.models.qwen4_exp import Qwen4ExpPinnedHostEmbedding
from torch import nn

from ple_um import MappedTable, delivered, envs
from ple_um.checkpoint import ShardLayout, check_shape, read_layout
from ple_um.delivered import ReloadMismatchError
from ple_um.served import ServedLayer, ServedTable, host_lookup_refused
from ple_um.sglang.source import table_directory

NOT_APPLIED = (
    "ple-um: PLE_UM is set but SGLang's Qwen4ExpPinnedHostEmbedding is not replaced (see the HookRegistry "
    "error logged at start-up); unset PLE_UM to run stock SGLang"
)

logger = logging.getLogger("ple_um.sglang")

# Tables whose bf16 rows a lookup writes straight into the output: BF16 (raw) and NVFP4 (decoded).
_INTO_OUT = ("BF16", "NVFP4")


__all__ = ["NOT_APPLIED", "PleUmHostEmbedding", "ReloadMismatchError", "applied"]


class PleUmHostEmbedding(ServedLayer, Qwen4ExpPinnedHostEmbedding):
    """This rank's rows of one Qwen4Exp PLE table, read from the checkpoint files through ple-um."""

    NOT_OPEN = (
        "the model's load_weights has not run (ple-um serves SGLang's safetensors loaders; startup "
        "weight-load overlap, which captures CUDA graphs before loading, and --load-format dummy are "
        "not supported)"
    )

    def __init__(self, embedding, *, backend: str = "pinned", table_dir: str | None = None) -> None:
        nn.Module.__init__(self)
        if not isinstance(embedding.quant_method, UnquantizedEmbeddingMethod):
            raise NotImplementedError("PLE embedding offload requires an unquantized embedding table")
        if embedding.num_added_embeddings:
            raise NotImplementedError("PLE embedding offload does not support added vocabulary rows")
        for name in self._COPIED_ATTRIBUTES:
            setattr(self, name, getattr(embedding, name))
        self.quant_method = None  # as stock: SGLang's post-load pass leaves this module alone
        source = embedding.weight
        weight = nn.Parameter(torch.empty((0, self.embedding_dim), dtype=source.dtype), requires_grad=False)
        for name, value in vars(source).items():
            setattr(weight, name, value)
        weight.weight_loader = self.weight_loader
        self.register_parameter("weight", weight)
        self.register_buffer("weight_scale", embedding.weight_scale, persistent=True)
        del embedding.weight
        # The model is built under `with target_device:`, where the scale was made.
        self.device = embedding.weight_scale.device
        if backend != "pinned" or table_dir:
            logger.info(
                "ple-um serves the PLE table from the checkpoint: --ple-offload-backend %s and "
                "--ple-offload-dir %s are not used",
                backend,
                table_dir,
            )
        # Set by the Qwen4ExpNGramEmbedding hook right after construction (``bind``).
        self.prefix = "ngram_embedding"
        self.layer: int | None = None
        self.split_ngram_parts: int | None = None
        self.served = ServedTable(logger, "SGLang")

    def bind(self, *, prefix: str, layer: int, split_ngram_parts: int) -> None:
        """Where this table is in the model and the checkpoint: the module prefix, the decoder layer
        index of the checkpoint's ``layers.<L>.ple`` names, the config's ``split_ngram_parts``."""
        self.prefix, self.layer, self.split_ngram_parts = prefix, layer, split_ngram_parts

    # -- the table ------------------------------------------------------------------------------
    def ensure_table(self) -> MappedTable:
        """This rank's rows of the table: the serving ones, or those of a new checkpoint directory (or
        of replaced files) opened and staged, to serve once ``finish_load`` has checked them."""
        if self.layer is None or self.split_ngram_parts is None:
            raise RuntimeError(f"{self.prefix}: built outside Qwen4ExpNGramEmbedding (bind() was not called)")
        directory = table_directory()
        return self.serve_table(
            directory,
            self.device,
            # Headers first: a table that does not fit the layer is refused before anything is mapped.
            fits=lambda: self._check_layout(read_layout(directory, self.layer)),
            check=self._check_capture,
            stage=True,
        )

    def _check_layout(self, layout: ShardLayout) -> None:
        """The checkpoint's table must be the one this layer was built for (stock SGLang places shard
        ``i`` at ``i * ceil(rows / split_ngram_parts)``, which ple-um's layout must agree with)."""
        check_shape(
            layout,
            self.prefix,
            row_dim=self.embedding_dim,
            num_rows=self.org_vocab_size,
            parts=self.split_ngram_parts,
        )
        if self.weight.dtype == torch.float8_e4m3fn and layout.dtype_name not in ("F8_E4M3", "NVFP4"):
            logger.warning(
                "ple-um: %s: the config stores the table as FP8 E4M3 but the checkpoint's is %s; stock "
                "SGLang would round its rows to FP8, ple-um serves them as stored",
                self.prefix,
                layout.dtype_name,
            )

    def delivered_cast(self, table: MappedTable) -> torch.dtype:
        """Stock SGLang copies a shard into its table cast to that table's dtype
        (``copy_ple_rows_to_tp_embedding``): E4M3 for an E4M3 table (its storage switches to E4M3 when
        such a shard arrives, or the config declares it), else bf16, the rows this layer's gather
        serves. Rows delivered in memory are compared after the same cast (NVFP4's never are)."""
        return torch.float8_e4m3fn if table.dtype == torch.float8_e4m3fn else torch.bfloat16

    def _check_capture(self, table: MappedTable) -> None:
        """A lookup that is not capture-safe (the cpu mode without its C row copy) waits for the device,
        which SGLang's CUDA graphs cannot hold."""
        if table.capture_safe or self.device.type != "cuda":
            return
        from sglang.srt.runtime_context import get_exec

        try:
            disabled = bool(get_exec().graph.disable_cuda_graph)
        except ValueError:  # no server arguments published (a layer built outside a server)
            disabled = False
        if not disabled:
            raise host_lookup_refused(
                self.prefix,
                table,
                "which a CUDA graph cannot capture",
                "start SGLang with --disable-cuda-graph",
            )

    def finish_load(self) -> None:
        """After a load: the table is open and agrees with the global scale SGLang loaded. A new table
        (another directory, replaced files) serves only then (``delivered.finish_load``): a refusal
        closes it and leaves the old one serving, ``weight_scale`` set back to the old one's."""
        delivered.finish_load(self)

    def global_scale(self) -> tuple[str, torch.Tensor, Callable[[MappedTable], float]]:
        """``weight_scale``, which SGLang holds as bf16 (``_load_qwen4_exp_ple_buffer``): the table's
        FP8 scale; NVFP4 rows are served decoded and 16-bit ones as stored: nothing to multiply, 1."""
        return (
            "weight_scale",
            self.weight_scale,
            lambda table: 1.0 if table.layout.is_nvfp4 or table.scale is None else table.scale,
        )

    def prefetch_stream(self, stream):
        """The side stream SGLang's PLE layer queues ``start_prefetch`` on: with PLE_UM_OVERLAP (the
        default) on a CUDA device, ``stream`` or a new one; else None (the lookup runs in forward)."""
        if not envs.PLE_UM_OVERLAP or self.device.type != "cuda":
            return None
        return stream if stream is not None else torch.cuda.Stream(self.device)

    # -- lookup ---------------------------------------------------------------------------------
    def gather(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 rows of the global n-gram ``input_ids`` (``input_ids.shape + (head_dim,)``), into ``out``
        when given (SGLang's prefetch and CUDA-graph buffers); zeros for ids this rank does not own."""
        expected = (*input_ids.shape, self.embedding_dim)
        if out is None:
            out = self.allocate_output(expected, input_ids.device)
        elif tuple(out.shape) != expected:
            raise ValueError(f"invalid PLE prefetch output shape: {tuple(out.shape)} != {expected}")
        elif out.dtype != torch.bfloat16 or out.device != input_ids.device:
            raise ValueError("PLE prefetch output must be bfloat16 on the id device")
        if input_ids.numel() == 0:
            return out
        table = self.require_table()
        self.served.note_lookup(input_ids)
        if table.layout.dtype_name in _INTO_OUT:
            table.lookup(input_ids, out=out)
        else:  # raw rows, converted as stock converts them (no scale: the model applies weight_scale)
            out.copy_(table.lookup(input_ids))
        return out


def applied() -> bool:
    """Whether SGLang's model module builds ple-um tables now (the hooks' class REPLACE took effect)."""
    from sglang.srt.models import qwen4_exp

    return qwen4_exp.Qwen4ExpPinnedHostEmbedding is PleUmHostEmbedding
