"""What both engines' plugins share: the table a layer serves, and the lookups a step starts early.

The vLLM backend and the SGLang embedding each hold one table per layer: this rank's rows of the
checkpoint's table, opened when the weights are loaded, and again when a later load names another
directory or finds the files replaced. What they share is here, importing nothing from vLLM or
SGLang; what each engine checks around an open, and how it calls a lookup, stays in its plugin.

- ``table_directory``: the checkpoint directory, ``PLE_UM_DIR``'s or else the engine's folder of the model.
- ``ServedTable``: the open table and its directory; a new table checked before it replaces the
  old one (closed when a check refuses it), the old one closed as soon as the new one serves
  (``MappedTable.close`` waits for the lookups already under way); the CUDA graphs that captured a
  lookup of it (they hold its mapping, so a remap is refused); the open's log line, at INFO with the
  probe's report for the first layer a plugin opens in the process and at DEBUG for the rest.
- ``ServedLayer``: what an engine's layer class gets from its ``ServedTable`` (the table, its rows,
  its ``extra_repr``, a delivered tensor compared, ``stats`` with a staged table, closing it).
- ``compare_shard`` (``ple_um.delivered``, here for the engines): a shard (or NVFP4's global scale) a
  load delivers in memory compared with the mapped bytes, since the table is served read-only
  (``ReloadMismatchError``); ``ServedTable.check_scale`` the global scale the engine loaded;
  ``host_lookup_refused`` a table the engine's graphs cannot hold.
- ``SideLookups`` and ``StepGroup``: the side stream the early lookups of a step are queued on, with
  a mark per layer, and which layers' starts of a step were taken early (and its log line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator

import torch

from ple_um import envs
from ple_um.checkpoint import replaced_files
from ple_um.delivered import Deliveries, abandon_load, compare_shard, layer_stats
from ple_um.errors import CheckpointError
from ple_um.lookup.streams import own_stream
from ple_um.opening import open_table
from ple_um.table import MappedTable

# The loggers (by name) that have written the INFO line of an open in this process.
_reported: set[str] = set()
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def table_directory(model_folder: Callable[[list[str]], str | None]) -> str:
    """The real path of the local directory that holds the PLE table: the one ``PLE_UM_DIR`` (alias
    ``VLLM_PLE_MMAP_DIR``) names, else the engine's local folder of the model, ``model_folder(tried)``
    (None where there is none, having added to ``tried`` why not; an empty variable counts as unset).
    CheckpointError naming the variable where it names no directory, or saying what was tried. No download."""
    directory = envs.PLE_UM_DIR
    found = envs.KNOBS["PLE_UM_DIR"].raw()
    if directory and not os.path.isdir(directory):
        raise CheckpointError(
            f"{found[0] if found else 'PLE_UM_DIR'}={directory!r} is not a directory: point it at the "
            "directory holding the checkpoint's *.safetensors files with the PLE shard tensors"
        )
    tried = [f"{found[0]}: set but empty" if found else "PLE_UM_DIR (alias VLLM_PLE_MMAP_DIR): unset"]
    directory = directory or model_folder(tried)
    if not directory:
        raise CheckpointError(
            "cannot find the checkpoint directory of the PLE table. Tried: "
            + "; ".join(tried)
            + ". Set PLE_UM_DIR to the directory holding the *.safetensors files with the "
            "...ple_embedding.ngram_embedding.shard_<i>.weight tensors."
        )
    return os.path.realpath(directory)


def capturing(ids: torch.Tensor) -> bool:
    """Whether a lookup of ``ids`` is being captured into a CUDA graph."""
    return ids.is_cuda and torch.cuda.is_current_stream_capturing()


def layer_index(prefix: str) -> int:
    """The decoder layer index in a PLE prefix (``...layers.<L>....``), which names the table's tensors."""
    found = _LAYER.findall(prefix)
    if not found:
        raise ValueError(f"cannot find the decoder layer index (layers.<L>.) in the PLE prefix {prefix!r}")
    return int(found[-1])


class ServedTable:
    """A layer's open table (``table``, or None) and the checkpoint directory it was opened from;
    ``logger`` is the plugin's, ``engine`` its name in messages. ``captured``: a CUDA graph captured
    a lookup of the open table (``note_lookup``)."""

    def __init__(self, logger: logging.Logger, engine: str) -> None:
        self.logger = logger
        self.engine = engine
        self.table: MappedTable | None = None
        self.directory: str | None = None
        self.captured = False
        # A table a load opened that does not serve yet (``serve(stage=True)``): (table, directory,
        # how it differs from the serving one), until ``commit`` or ``discard``.
        self.staged: tuple[MappedTable, str, str] | None = None

    def open_at(self, directory: str) -> MappedTable | None:
        """The open table when it was opened from ``directory`` and its files there were not replaced
        since (``replaced_files``), else None: the caller opens one."""
        table = self.table
        return None if table is None or self.directory != directory or replaced_files(table.layout) else table

    def require(self, prefix: str, why: str) -> MappedTable:
        """The open table, or RuntimeError naming the layer (``prefix``) and ``why`` none is open."""
        if self.table is None:
            raise RuntimeError(f"{prefix}: the table is not open: {why}")
        return self.table

    def check_scale(
        self, prefix: str, name: str, scale: torch.Tensor, expected: float, table: MappedTable | None = None
    ) -> None:
        """The global scale ``name`` the engine loaded (``scale``, in the dtype it holds it in) must be
        ``expected`` in that dtype (the scale of ``table``, by default the open one, or 1 where the
        engine multiplies by none): PLE_UM_DIR may name another checkpoint's table."""
        loaded = scale.detach().float().cpu().reshape(-1)
        if torch.equal(loaded, torch.full_like(loaded, expected).to(scale.dtype).float()):
            return
        table = table if table is not None else self.table
        raise CheckpointError(
            f"{prefix}: {self.engine} loaded {name} {loaded.tolist()} but the mapped table's scale is "
            f"{table.scale} ({table.layout.dtype_name}): the table in the checkpoint directory does not "
            "belong to this checkpoint (PLE_UM_DIR?)",
            path=table.layout.scale_path,
            tensor=table.layout.scale_tensor,
        )

    def note_lookup(self, ids: torch.Tensor) -> None:
        """A lookup of ``ids`` is queued: when a graph captures it, the graphs hold the table."""
        if capturing(ids):
            self.captured = True

    def serve(
        self,
        prefix: str,
        directory: str,
        open_new: Callable[[], MappedTable],
        *,
        fits: Callable[[], None] | None = None,
        check: Callable[[MappedTable], None] | None = None,
        stage: bool = False,
    ) -> MappedTable:
        """The table of ``directory``: the open one when it was opened from there; else a remap
        captured graphs would not see is refused, ``fits`` checks the headers before anything is
        mapped, the table is opened (``open_new``) and ``check``-ed (a raise closes it and leaves the
        old one serving), then serves in place of the old one, which is closed (``commit``). With
        ``stage`` it does not serve yet: it is held (and returned again for ``directory``) until
        ``commit`` makes it serve or ``discard`` closes it, so that what a load checks at its end
        can still leave the old table serving. ``prefix`` names the layer in messages and log lines."""
        if (table := self.open_at(directory)) is not None:
            return table
        staged = self.staged
        if staged is not None and staged[1] == directory and not replaced_files(staged[0].layout):
            if not stage:
                self.commit(prefix)
            return staged[0]
        self.discard()
        how = f"the PLE table moved from {self.directory} to {directory}"
        if self.table is not None and self.directory == directory:  # its files replaced
            names = ", ".join(os.path.basename(path) for path in replaced_files(self.table.layout))
            how = f"its files in {directory} changed on disk ({names})"
        if self.table is not None and self.captured:
            raise RuntimeError(
                f"{prefix}: {how} after CUDA graphs captured its lookup; the captured graphs read the "
                f"old mapping. Restart {self.engine} on the new checkpoint"
            )
        if fits is not None:
            fits()
        table = open_new()
        try:
            if check is not None:
                check(table)
        except BaseException:
            table.close()
            raise
        self.staged = (table, directory, how)
        if not stage:
            self.commit(prefix)
        return table

    def commit(self, prefix: str) -> None:
        """The staged table, if any, serves in place of the old one, which is closed."""
        if self.staged is None:
            return
        (table, directory, how), self.staged = self.staged, None
        old, self.table, self.directory = self.table, table, directory
        if old is not None:
            self.logger.info("ple-um: %s remapped: %s", prefix, how)
            old.close()
        self._report(prefix, table)

    def discard(self) -> None:
        """Close the staged table, if any: the serving one serves on."""
        staged, self.staged = self.staged, None
        if staged is not None:
            staged[0].close()

    def _report(self, prefix: str, table: MappedTable) -> None:
        (start, end), layout = table.rows, table.layout
        row = f"{layout.row_bytes} B per row"
        if layout.has_block_scales:
            row = f"{layout.row_bytes} B + {layout.row_dim // layout.block_size} B of block scales per row"
        line = "ple-um: %s served from %s in the %s mode: rows [%d, %d) of %d, %s, %s, capture-safe=%s"
        args = (prefix, layout.directory, table.mode, start, end, table.num_rows)
        args += (layout.dtype_name, row, table.capture_safe)
        if self.logger.name in _reported:
            self.logger.debug(line, *args)
            return
        _reported.add(self.logger.name)
        self.logger.info(line + "\n%s", *args, table.report.describe())

    def close(self) -> None:
        """Close the table and a staged one, idempotently (its graphs go with it: none holds the next one)."""
        self.discard()
        table, self.table, self.directory, self.captured = self.table, None, None, False
        if table is not None:
            table.close()


class ServedLayer:
    """What an engine's PLE layer class (a subclass of the engine's vocab-parallel embedding, listed
    before it) gets from the ``ServedTable`` it holds as ``served``: ``NOT_OPEN`` says why a lookup
    can find no table in that engine."""

    NOT_OPEN = "the model's load_weights never ran for this layer"
    served: ServedTable
    prefix: str
    layer: int  # the decoder layer whose table the checkpoint names (``layers.<L>.ple``)
    shards_compared = 0  # table tensors a load delivered in memory, compared with the files
    ensure_table: Callable[[], MappedTable]  # the engine's: open the table, or remap it

    @property
    def table(self) -> MappedTable | None:
        """The open table, or None before the model's weights were loaded."""
        return self.served.table

    @property
    def owned_rows(self) -> tuple[int, int]:
        """This rank's global row range of the table."""
        return self.shard_indices.org_vocab_start_index, self.shard_indices.org_vocab_end_index

    def serve_table(
        self,
        directory: str,
        device: torch.device,
        *,
        fits: Callable[[], None],
        check: Callable[[MappedTable], None],
        stage: bool = False,
    ) -> MappedTable:
        """This rank's rows of the table in ``directory``, opened in the ``PLE_UM_MODE`` mode on
        ``device`` and served, or with ``stage`` staged (``ServedTable.serve``: ``fits`` before the
        open, ``check`` after)."""
        return self.served.serve(
            self.prefix,
            directory,
            lambda: open_table(
                directory, layer=self.layer, rows=self.owned_rows, mode=envs.PLE_UM_MODE, device=device
            ),
            fits=fits,
            check=check,
            stage=stage,
        )

    def delivered_cast(self, table: MappedTable) -> torch.dtype | None:
        """The dtype the engine's stock loader casts rows of ``table`` it is delivered to as it copies
        them into its own table (``compare_shard``'s ``cast``); None: only the storage dtype."""
        del table
        return None

    def require_table(self) -> MappedTable:
        return self.served.require(self.prefix, self.NOT_OPEN)

    def compare_delivered(self, index: int, tensor: torch.Tensor, kind: str) -> None:
        """A table tensor a load delivered in memory (``compare_shard``'s ``index`` and ``kind``),
        compared with the mapped files of the table, opened if need be (``ensure_table``), never
        copied: the table is read-only. A difference raises ReloadMismatchError."""
        table = self.ensure_table()
        self.shards_compared += 1
        compare_shard(self.prefix, table, index, tensor, kind, cast=self.delivered_cast(table))
        self.deliveries().note(index, kind, table)

    def deliveries(self) -> Deliveries:
        """What the load under way delivered of the table in memory."""
        return vars(self).setdefault("_ple_um_deliveries", Deliveries())

    def global_scale(self) -> tuple[str, torch.Tensor | None, Callable[[MappedTable], float | None]]:
        """The engine's: the global scale it loads beside the table, as (its name, the layer's tensor
        of it or None while there is none to check, the value a table needs it to hold or None)."""
        raise NotImplementedError

    def abandon_load(self) -> None:
        """A load failed (``delivered.abandon_load``): the old table serves on, with its scale."""
        abandon_load(self)

    def stats(self, *, sync: bool = True) -> dict:
        """The serving table's ``stats`` and the ``staged`` table (``delivered.layer_stats``)."""
        return layer_stats(self, sync)

    def close_table(self) -> None:
        """Release the table's mappings and access resources; idempotent."""
        self.served.close()

    def extra_repr(self) -> str:
        table = self.served.table
        state = f"{table.mode} mode, {table.layout.directory}" if table is not None else "not open"
        start, end = self.owned_rows
        return f"rows=[{start}, {end}) of {self.org_vocab_size}, row_dim={self.embedding_dim}, {state}"


def host_lookup_refused(prefix: str, table: MappedTable, why: str, flags: str) -> RuntimeError:
    """The error for a table that is not capture-safe (the cpu mode without its C row copy: its lookup
    waits for the device) where the engine's CUDA graphs cannot hold it: ``why`` not, and ``flags``,
    the engine's flags that work."""
    return RuntimeError(
        f"ple-um serves {prefix} in the {table.mode} mode without its host node ({table.row_reads}): the "
        f"lookup waits for the device; {why}. Make the C row copy available (a working C compiler, "
        f"PLE_UM_ROWCOPY=1), {flags}, or make a GPU mode available (why not: {table.report.reasons})"
    )


class SideLookups:
    """Lookups queued on one side stream of ple-um's own, forked from the current stream, each
    joined back on its own: the early lookups of a step (several layers' lookups started together,
    each taken where its layer needs the rows), or one layer's prefetch.

    ``fork`` makes the side stream wait for the current one and sends the work queued inside to the
    side stream; ``mark(key)`` records, on the side stream, that the work queued so far for ``key``
    is queued; ``join(key)`` makes the current stream wait for that mark only, not for the lookups
    queued after it. All are stream operations, so a CUDA graph captured across them holds the fork
    and every join; a graph's capture must join every key it forked (the last key joins them all).
    """

    def __init__(self) -> None:
        self.stream = None
        self._marks: dict[object, torch.cuda.Event] = {}

    @contextlib.contextmanager
    def fork(self, device: torch.device) -> Iterator[None]:
        if self.stream is None:
            self.stream = own_stream(device)  # not a torch pool stream: never the one being captured
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            yield

    def mark(self, key: object) -> None:
        """Within ``fork``: the work queued so far is what ``join(key)`` waits for."""
        if key not in self._marks:
            self._marks[key] = torch.cuda.Event()
        self._marks[key].record(self.stream)

    def join(self, key: object, device: torch.device) -> None:
        """The current stream waits for ``key``'s mark."""
        torch.cuda.current_stream(device).wait_event(self._marks[key])


class StepGroup:
    """The PLE layers of one model whose starts of a step are taken together, by the first layer's
    (``PLE_UM_EARLY_LOOKUPS``): ``start`` answers each layer's start; a step is its inputs, compared
    by identity (the engines hand every layer the same objects in one forward, and holding them
    keeps another forward's from taking their identity)."""

    def __init__(self, layers: list) -> None:
        self.layers = list(layers)
        # The inputs of the step whose starts were taken early, and the layers (by position in
        # ``layers``) started then whose own start has not come yet.
        self.step: tuple | None = None
        self.pending: set[int] = set()

    def start(self, layer, step: tuple, start_from: Callable[[list], bool]) -> bool:
        """The engine's start of ``layer``'s lookup for ``step``: True when it is taken, by an earlier
        layer's start of the step or now, where ``start_from`` started ``layer``'s and every later
        layer's; False when the caller runs the stock start (a layer outside the group, early
        lookups off, or ``start_from`` declined)."""
        position = next((i for i, member in enumerate(self.layers) if member is layer), None)
        if position is None:
            return False
        same = self.step is not None and all(a is b for a, b in zip(self.step, step, strict=True))
        if same and position in self.pending:
            self.pending.discard(position)
            if not self.pending:
                self.step = None  # the step's last start: its inputs are not held past it
            return True
        if envs.PLE_UM_EARLY_LOOKUPS == "off" or not start_from(self.layers[position:]):
            return False
        self.step, self.pending = step, set(range(position + 1, len(self.layers)))
        return True

    def announce(self, logger: logging.Logger, how: str, buffers: str, why_not: str | None = None) -> None:
        """Log the group at INFO: ``how`` the step's lookups run, ``buffers`` the memory they write;
        or why its starts are not taken early (``why_not``, the engine's reason, or the knob off)."""
        mode, count = envs.PLE_UM_EARLY_LOOKUPS, len(self.layers)
        if why_not or mode == "off":
            line = "ple-um: early lookups not taken (%s): each of the %d PLE layers looks its own rows up"
            logger.info(line, why_not or "PLE_UM_EARLY_LOOKUPS=off", count)
            return
        line = "ple-um: early lookups %s (PLE_UM_EARLY_LOOKUPS): the first of %d PLE layers' start_prefetch "
        line += "starts all %d lookups of a step, %s; their rows go to the layers' own prefetch buffers, %s"
        logger.info(line, mode, count, count, how, buffers)
