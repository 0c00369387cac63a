"""DeepSeek-V4.1's Engram tables served by ple-um in vLLM 0.33 (``PLE_UM=1``).

vLLM builds every Engram layer's table through one factory, ``Engram._create_embedding``
(``vllm.models.deepseek_v41.common.engram``). ``apply()`` (called by the plugin's ``register``)
replaces that class attribute (``patch.replace``, which keeps the original on the class); the
replacement reads PLE_UM each time a layer is built and, with it set, builds
``MappedEngramEmbedding``: a ``ParallelEngramEmbedding`` that holds no copy of the table. Its
parameters are empty; their weight loader checks the tensor vLLM hands over (name, shape, dtype;
a view of the table's files is not read, a tensor in memory, from a weight sync or a reload, is
compared with this rank's mapped rows, since the table is read-only) and, once both the rows and the
E8M0 scales of the table have been handed over, opens this rank's rows from the checkpoint files
(``open_engram_table``, rows = this rank's heads, checked against vLLM's own ``EngramLayout``). A new
table (another directory, replaced files) is staged and serves only once checked, as a PLE layer's
(``ServedLayer``, ``delivered.finish_load``): a sync that delivered its rows in memory but not yet
its scales leaves it staged, said in the log and in ``stats()["staged"]``, the old table serving; a
refusal closes it. ``apply()`` also wraps the text model's ``load_weights``
(``DeepseekV41LLMForCausalLM``): a model's load (or one call of a sync) finishes every Engram layer's
load once, at its end (``delivered.load_model``), and one that fails anywhere in vLLM's loader
abandons it (the staged table closed, what the load delivered forgotten).
Its ``lookup`` is the one vLLM's layer calls, with vLLM's arguments, on the stream vLLM chose:
inline, or on the Engram prefetch stream forked before layer 0 (``cpu_offload``, the default),
captured in FULL graphs or run at the eager breaks of breakable ones as stock. The rows come back as
stock returns them, bit for bit: BF16 of ``float32(e4m3)`` times the float32 whose bits are the E8M0
byte ``e << 23`` (``2**(e-127)``, but 0 for ``e = 0``). ``apply()`` also replaces the model's
``drop_checkpoint_cache``, which ``use_thp`` calls to make room for huge-page host tables: with
PLE_UM set there are none, and the checkpoint's page cache, the tables' rows, is kept (logged).

Served: tensor parallelism (heads split evenly over the ranks), data parallelism with one table
per replica or ``dp_shared_memory`` (every replica maps the same files: the page cache is the
shared copy), ``cpu_offload`` on (prefetch stream) or off (inline lookups). Refused at start-up,
with the reason: heads that do not split evenly over the TP ranks, and the DP-sharded layouts
(``embedding_across_dp``, or a DP group sharing one table without ``dp_shared_memory``: vLLM's
all-gather and peer exchange of rows); and, once the table is open, one whose lookup waits for the
device (the cpu mode without its C row copy) under CUDA graphs that would capture it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch
from torch import nn
from vllm.config import CUDAGraphMode, get_current_vllm_config
from vllm.distributed import (
    get_engram_dp_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.logger import init_logger
from vllm.model_executor.utils import set_weight_attrs
from vllm.models.deepseek_v41.common.engram import ParallelEngramEmbedding

from ple_um import delivered, envs
from ple_um.checkpoint import MXFP8_BLOCK, EngramGeometry, read_engram_layout
from ple_um.errors import CheckpointError
from ple_um.opening import open_engram_table
from ple_um.served import ServedLayer, ServedTable, host_lookup_refused
from ple_um.table import MappedTable
from ple_um.vllm.backend import check_cudagraph_mode
from ple_um.vllm.patch import replace
from ple_um.vllm.source import TableSource, file_backing

logger = init_logger("vllm.ple_um.engram")

ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
# NVIDIA's DeepSeek-V4.1 model: with use_thp it releases the checkpoint's page cache, by this name.
MODEL_MODULE, DROP = "vllm.models.deepseek_v41.nvidia.model", "drop_checkpoint_cache"
ROCM_MODEL_MODULE = "vllm.models.deepseek_v41.amd.model"
# The text model whose load_weights loads the Engram layers (the multimodal wrapper delegates to it).
MODEL_CLASS = "DeepseekV41LLMForCausalLM"


class EngramLayoutError(ValueError):
    """An Engram configuration ple-um does not serve; the message says why and what to change."""


def apply() -> list[str]:
    """Patch ``Engram._create_embedding``, the text model's ``load_weights`` and NVIDIA's
    ``drop_checkpoint_cache``; returns what was patched now (empty when it already was)."""
    module = importlib.import_module(ENGRAM_MODULE)
    original = module.Engram.__dict__["_create_embedding"]
    patched = []
    if replace(module.Engram, {"_create_embedding": _patched_create_embedding(original)}):
        patched.append(f"{ENGRAM_MODULE}.Engram._create_embedding")
    from vllm.platforms import current_platform

    rocm = current_platform.is_rocm()
    model = importlib.import_module(ROCM_MODEL_MODULE if rocm else MODEL_MODULE)
    cls = getattr(model, MODEL_CLASS)
    if replace(cls, {"load_weights": _model_load_weights(cls.load_weights)}):
        patched.append(f"{model.__name__}.{MODEL_CLASS}.load_weights")
    if not rocm:  # ROCm's model releases no page cache
        if DROP in vars(model) and replace(model, {DROP: _kept_page_cache(getattr(model, DROP))}):
            patched.append(f"{MODEL_MODULE}.{DROP}")
    return patched


def _model_load_weights(original):
    """DeepSeek-V4.1's ``load_weights`` (one model load, or one call of a weight sync), run by
    ``delivered.load_model``: its Engram layers finish the load once, at its end (every new table
    checked before any serves; one delivered only in part stays staged, the old one serving), not
    as each tensor arrives. A load that fails, wherever in vLLM's loader, ends as a failed one for
    every layer: a table it staged is closed and what it delivered forgotten, so that a later
    load's tensors never complete a table with the failed load's."""

    @functools.wraps(original)
    def load_weights(self, weights):
        layers = [m for m in self.modules() if isinstance(m, MappedEngramEmbedding)]
        if not layers:
            return original(self, weights)
        for layer in layers:
            layer._received.clear()  # a model's load ends a load of the layer alone
        return delivered.load_model(layers, lambda: original(self, weights))

    return load_weights


def _kept_page_cache(original):
    """vLLM's ``drop_checkpoint_cache`` as DeepSeek-V4.1's model calls it with ``use_thp``: before it
    allocates its Engram host tables and again after loading (before MADV_COLLAPSE), it drops every
    checkpoint file's page cache (POSIX_FADV_DONTNEED), to give those huge-page tables memory. With
    PLE_UM set there are no host tables (``use_thp`` has nothing to apply to) and the Engram tables
    are read from those very pages, maybe prewarmed, maybe another rank's or process's: the release
    is skipped, and logged. Unset, the stock release runs."""

    @functools.wraps(original)
    def drop_checkpoint_cache(model_name_or_path, *args, **kwargs):
        if not envs.PLE_UM:
            return original(model_name_or_path, *args, **kwargs)
        logger.info(
            "ple-um: use_thp: the page cache of the checkpoint in %s is kept: vLLM releases it to give "
            "its huge-page Engram host tables memory, and with PLE_UM there are none; the Engram tables "
            "are read from those pages",
            model_name_or_path,
        )
        return None

    return drop_checkpoint_cache


def _patched_create_embedding(original):
    @functools.wraps(original)
    def _create_embedding(self, layout, layer_hash_index: int):
        if not envs.PLE_UM:
            return original(self, layout, layer_hash_index)
        engram_config = get_current_vllm_config().engram_config
        assert engram_config is not None
        return MappedEngramEmbedding(
            geometry_of(layout),
            layout.layer_ids[layer_hash_index],
            cpu_offload=engram_config.cpu_offload,
            dp_shared_memory=bool(engram_config.dp_shared_memory),
        )

    return _create_embedding


def geometry_of(layout) -> EngramGeometry:
    """ple-um's geometry of vLLM's ``EngramLayout`` (its own primes, in table order)."""
    return EngramGeometry(
        layer_ids=tuple(layout.layer_ids),
        num_rows=tuple(layout.num_embeddings),
        head_dim=layout.head_dim,
        head_sizes=tuple(tuple(p for order in layer for p in order) for layer in layout.primes),
    )


class MappedEngramEmbedding(ServedLayer, ParallelEngramEmbedding):
    """What ``ParallelEngramEmbedding`` keeps of the table, kept in the checkpoint files instead:
    the attributes vLLM's layer and model read, empty parameters whose loader reads no data, and a
    ``lookup`` through this rank's mapped rows. The table a load opens is staged, checked and
    served as a PLE layer's (``ServedLayer``: its deliveries, ``stats``, ``abandon_load``)."""

    NOT_OPEN = "the checkpoint's Engram tensors were never loaded"

    def __init__(self, geometry: EngramGeometry, layer_id: int, *, cpu_offload: bool, dp_shared_memory: bool):
        nn.Module.__init__(self)  # not vLLM's constructor: it allocates the table
        index = geometry.index(layer_id)
        head_sizes = geometry.head_sizes[index]
        self.layer_id, self.geometry = layer_id, geometry
        self.prefix = f"Engram layer {layer_id}"
        dp_size = 1 if dp_shared_memory else get_engram_dp_size()
        if dp_size > 1:
            raise EngramLayoutError(
                f"ple-um: {self.prefix}: the table is sharded over {dp_size} DP replicas "
                "(embedding_across_dp, or co-located replicas without dp_shared_memory); ple-um serves "
                "each replica's heads from the files and does not take part in vLLM's DP row exchange: "
                "unset embedding_across_dp, or set dp_shared_memory (every replica then maps the same "
                "files), or unset PLE_UM"
            )
        self.tp_size = get_tensor_model_parallel_world_size()
        self.n_hash_cols = len(head_sizes)
        if self.n_hash_cols % self.tp_size:
            raise EngramLayoutError(
                f"ple-um: {self.prefix}: {self.n_hash_cols} hash heads do not split evenly over "
                f"{self.tp_size} TP ranks; ple-um serves even splits only (unset PLE_UM for this layout)"
            )
        self.cpu_offload, self.dp_shared_memory, self.use_thp = cpu_offload, dp_shared_memory, False
        self.dp_size, self.peer_rows, self._packed, self._shared_memory = 1, 0, None, None
        self.num_embeddings, self.dim, self.block_size = (
            geometry.num_rows[index],
            geometry.head_dim,
            MXFP8_BLOCK,
        )
        self.part_n_hash_cols = self.n_hash_cols // self.tp_size
        self.head_start = get_tensor_model_parallel_rank() * self.part_n_hash_cols
        self.vocab_start_idx, self.vocab_end_idx = geometry.head_rows(
            layer_id, self.head_start, self.head_start + self.part_n_hash_cols
        )
        self.part_num_embeddings = self.vocab_end_idx - self.vocab_start_idx
        self.weight = nn.Parameter(torch.empty(0, self.dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        scales = torch.empty(0, self.dim // MXFP8_BLOCK, dtype=torch.uint8)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        for param in (self.weight, self.weight_scale_inv):
            set_weight_attrs(param, {"weight_loader": self._receive})
        self._received: set[str] = set()  # the tensors a load of this layer alone delivered so far
        # Set while the model's load_weights runs (``_model_load_weights``): it finishes the load.
        self.in_model_load = False
        self._vllm_config = get_current_vllm_config()
        self.source = TableSource(self._vllm_config)
        self.served = ServedTable(logger, "vLLM")

    @property
    def owned_rows(self) -> tuple[int, int]:
        """This rank's rows of the table: those of its heads."""
        return self.vocab_start_idx, self.vocab_end_idx

    def _receive(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """vLLM's weight loader for both parameters: the tensor's shape and dtype are checked (the
        file it is a view of named where it is one). A view of one of the table's files is not read,
        nor one on the meta device (no data): the load brings the table's files
        (``Deliveries.note_files``). A tensor in memory (a weight sync, a reload from an iterator) is
        compared with this rank's mapped rows (ReloadMismatchError where it differs), the table opened
        for it (a new one staged). Inside the model's load_weights, that load finishes at its end
        (``_model_load_weights``). A layer loaded on its own checks the load's end here
        (``delivered.finish_load``): after a tensor in memory (a new table the load delivered only
        part of in memory stays staged, the old one serving) and once rows and scales are both in
        (a staged one serves). A refusal closes the staged table, the old one serving on
        (``abandon_load``)."""
        scales = param is self.weight_scale_inv
        expect = (self.num_embeddings, self.dim // MXFP8_BLOCK if scales else self.dim)
        dtypes = (torch.uint8, torch.float8_e8m0fnu) if scales else (torch.float8_e4m3fn,)
        what = "weight_scale_inv" if scales else "weight"
        backing = file_backing(loaded)
        if tuple(loaded.shape) != expect or loaded.dtype not in dtypes:
            raise CheckpointError(
                f"ple-um: {self.prefix}: the checkpoint's {what} is {loaded.dtype} {list(loaded.shape)}, "
                f"the layer expects {' or '.join(map(str, dtypes))} {list(expect)}",
                **self._checkpoint_tensor(scales, backing),
            )
        in_memory = loaded.device.type != "meta" and (
            backing is None or not self.source.is_table_file(backing[0])
        )
        try:
            if in_memory:
                given = loaded.view(torch.uint8) if scales else loaded  # E8M0 exponents: their bytes
                self.compare_delivered(0, given, "weight_scale" if scales else "weight")
            else:
                self.deliveries().note_files()
            if self.in_model_load:
                return
            self._received.add(what)
            done = self._received == {"weight", "weight_scale_inv"}
            if done:
                self._received.clear()
            if done or in_memory:
                delivered.finish_load(self)
        except BaseException:
            self._received.clear()
            self.abandon_load()  # a new table closed: the old one serves on
            raise

    def _checkpoint_tensor(self, scales: bool, backing: tuple[str, int] | None) -> dict:
        """Where the table's rows (or with ``scales`` its E8M0 scales) are in the checkpoint, for an
        error: ``tensor``, the full name in the checkpoint's index (its headers', which vLLM's weights
        mapper renames before the loader sees it), and ``path``, the file a delivered view is of,
        else the file that holds it. Where the headers cannot tell, the name without a prefix."""
        kind = "scale" if scales else "weight"
        tensor, path = f"layers.{self.layer_id}.engram.embed.{kind}", backing[0] if backing else None
        try:
            table = self.served.table
            layout = (
                table.layout
                if table is not None
                else read_engram_layout(self.source.directory(), self.layer_id, self.geometry)
            )
            spec = (layout.block_scales if scales else layout.shards)[0]
            tensor, path = spec.tensor, path or spec.path
        except (CheckpointError, OSError, IndexError, ValueError):
            pass
        return {"path": path, "tensor": tensor}

    def ensure_table(self) -> MappedTable:
        """This rank's rows of the table in the checkpoint directory: the serving ones, or a new
        table's opened and staged (``ServedTable.serve``), to serve once ``delivered.finish_load``
        has checked the load."""
        directory = self.source.directory()
        return self.served.serve(
            self.prefix,
            directory,
            lambda: open_engram_table(
                directory, layer=self.layer_id, rows=self.owned_rows, geometry=self.geometry
            ),
            check=self._check_capture,
            stage=True,
        )

    def global_scale(self) -> tuple[str, None, Callable[[MappedTable], None]]:
        """None: an MXFP8 Engram table has block scales (E8M0, ``weight_scale_inv``) and no global scale."""
        return "weight_scale_inv", None, lambda table: None

    def extra_repr(self) -> str:
        table = self.served.table
        state = f"{table.mode} mode, {table.layout.directory}" if table is not None else "not open"
        start, end = self.owned_rows
        return f"rows=[{start}, {end}) of {self.num_embeddings}, head_dim={self.dim}, {state}"

    def _check_capture(self, table: MappedTable) -> None:
        """A table that is not capture-safe (the cpu mode without its C row copy: its lookup waits
        for the device) can only be looked up in an eager break, which vLLM's Engram layer makes
        around its prefetch (``cpu_offload``), as for a PLE layer (``check_cudagraph_mode``); with
        ``cpu_offload`` off the lookup runs inline in the captured step: graphs refused."""
        config = self._vllm_config
        if self.cpu_offload or table.capture_safe:
            check_cudagraph_mode(self.prefix, table, config)
            return
        mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
        if mode is not None and mode != CUDAGraphMode.NONE:
            raise host_lookup_refused(
                self.prefix,
                table,
                f"with cpu_offload off vLLM looks it up inside its captured graphs ({mode.name})",
                "or start vLLM with -cc.cudagraph_mode=NONE, or with the Engram cpu_offload on",
            )

    def _storage(self):
        raise RuntimeError(
            f"ple-um: {self.prefix}: the table has no storage tensors; it is read through lookup()"
        )

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """This rank's heads of ``indices`` [T, n_hash_cols] (global row ids) into ``out``
        [T, local heads, dim] (BF16), queued on the current stream; ``background`` (vLLM's hint to
        leave SMs free) does not apply to ple-um's lookup."""
        table = self.require_table()
        if out.dtype == torch.uint8:
            raise EngramLayoutError(f"ple-um: {self.prefix}: packed lookups serve only vLLM's DP exchange")
        if indices.shape[0] == 0:
            return
        heads = indices[:, self.head_start : self.head_start + self.part_n_hash_cols]
        self.served.note_lookup(heads)  # a graph that captures it holds the mapping: a remap is refused
        table.lookup(heads, out=out.view(indices.shape[0], self.part_n_hash_cols, self.dim))
