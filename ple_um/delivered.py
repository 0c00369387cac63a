"""A table tensor that a load delivers in memory (a reload from an iterator, a weight sync), compared
with what the served table maps: ple-um serves the table read-only from the checkpoint files, so a
tensor that differs cannot be taken and is refused (``ReloadMismatchError``), naming the first row
that differs, the file and the tensor. Shared by both engines' plugins (``served``) and vLLM's
Engram layer; imports neither engine. The end of a load is shared too (``finish_load``): a new
table serves only once checked against what the load delivered (``Deliveries``: all of it, where
a weight sync spreads it over several calls) and the global scale the engine loaded.
"""

from __future__ import annotations

import torch

from ple_um.checkpoint.naming import block_scale_name
from ple_um.errors import CheckpointError, PleUmError
from ple_um.table import MappedTable

# Rows compared per lookup when a load delivers a shard in memory.
_COMPARE_ROWS = 1 << 16


class ReloadMismatchError(PleUmError, ValueError):
    """A load delivered shard rows in memory that differ from the mapped checkpoint files."""


def compare_shard(
    prefix: str,
    table: MappedTable,
    index: int,
    tensor: torch.Tensor,
    kind: str = "weight",
    *,
    cast: torch.dtype | None = None,
) -> None:
    """Checkpoint tensor ``shard_<index>.<kind>``, delivered in memory by a load, must equal what
    ``table`` maps: ``weight`` the rows, ``weight_scale`` the block scales (NVFP4's; MXFP8's E8M0 bytes
    as uint8), both this rank's rows of them, ``weight_scale_2`` NVFP4's global scale (``index`` -1).
    With ``cast``, the dtype the engine's stock table holds the rows of a table without block scales
    (FP8, 16-bit) in, rows delivered in any dtype are cast to it, as stock vLLM's loader copies them
    into its table (``source.to(dtype=target.dtype)``), and compared with the mapped rows cast to it
    the same way (the rows the engine's layer serves: raw where it is the storage dtype, else
    converted as a lookup converts them, the same rounding). Else, and for packed NVFP4 bytes and
    scales (which a cast would reinterpret), another dtype than the storage one is refused.
    ReloadMismatchError names the first row that differs, the file and the tensor."""
    layout = table.layout
    if kind == "weight_scale_2":
        given = tensor.detach().float().cpu().reshape(-1)
        if not layout.is_nvfp4 or not torch.equal(given, torch.full_like(given, layout.scale)):
            raise _differs(
                prefix, f"the global scale {given.tolist()}", layout.scale_path, layout.scale_tensor
            )
        return
    if not 0 <= index < layout.parts:
        raise CheckpointError(
            f"{prefix}: shard index {index} is outside the table's {layout.parts} shards",
            tensor=f"shard_{index}.{kind}",
        )
    if kind == "weight_scale" and not layout.has_block_scales:
        rows = layout.shards[index]
        raise ReloadMismatchError(
            f"{prefix}: NVFP4 block scales of shard {index} ({block_scale_name(rows.tensor)}) were "
            f"delivered in memory, but the table in {rows.path} stores {layout.dtype_name} rows without "
            f"block scales ({rows.tensor}); ple-um serves the checkpoint files read-only: write the new "
            "table to a checkpoint directory and reload from that path"
        )
    spec = layout.shards[index] if kind == "weight" else layout.block_scales[index]
    stored = table.dtype if kind == "weight" else layout.scale_layout().dtype
    what = f"shard {index}" + ("" if kind == "weight" else " block scales")
    castable = cast is not None and kind == "weight" and not layout.has_block_scales
    compared = cast if castable else stored  # the dtype both sides are compared in
    if tensor.dim() != 2 or tensor.shape[0] != spec.rows or (tensor.dtype != stored and not castable):
        raise ReloadMismatchError(
            f"{prefix}: {what} was delivered as {tensor.dtype} {tuple(tensor.shape)}, but the table in "
            f"{spec.path} ({spec.tensor}) is {stored} with {spec.rows} rows; ple-um serves the checkpoint "
            "files read-only"
        )
    start, (row_start, row_end) = layout.shard_start(index), table.rows
    for a in range(max(start, row_start), min(start + spec.rows, row_end), _COMPARE_ROWS):
        b = min(start + spec.rows, row_end, a + _COMPARE_ROWS)
        ids = torch.arange(a, b, device=table.device)
        if layout.has_block_scales:
            mapped = table.lookup_packed(ids)[0 if kind == "weight" else 1].view(torch.uint8)
        else:
            mapped = table.lookup(ids).to(compared).view(torch.uint8)
        given = tensor[a - start : b - start].to(device=table.device, dtype=compared)
        given = given.contiguous().view(torch.uint8)
        if not torch.equal(mapped, given):
            row = a + int((mapped != given).any(dim=1).nonzero()[0])
            raise _differs(prefix, f"{what} at row {row}", spec.path, spec.tensor)


def _differs(prefix: str, what: str, path: str | None, tensor: str | None) -> ReloadMismatchError:
    return ReloadMismatchError(
        f"{prefix}: {what} delivered in memory differs from the mapped checkpoint (file {path}, tensor "
        f"{tensor}). ple-um serves the table read-only from the checkpoint files: write the new table to "
        "a checkpoint directory and reload from that path, or unset PLE_UM to keep the table in memory"
    )


class Deliveries:
    """The table tensors a load under way delivered in memory (``note``; the global scale the engine
    loads itself, ``note_scale``), until the load finishes (``clear``). A load that delivered some of a
    table's tensors in memory but not all of them is partial: a weight sync spread over several
    ``load_weights`` calls, whose new table is checked once all of it is in (``partial``), as stock
    vLLM's layerwise reload processes a layer once all its weights are loaded. While it waits, the
    global scale the sync delivered is held here (``held``), the old table serving with its own. A
    load from the checkpoint files (``note_files``: a table tensor delivered as a view of the
    table's files, or the engine's loader leaving the table's files out since ple-um maps them)
    brings the whole table, its files, whatever else it delivers in memory: it is never partial,
    and ends a sync that delivered only part of the table before it. Shard tensors count for the
    table they were compared with (``compared``) only: a remap or replaced files that put another
    table in its place mid-sync leave the new one lacking them, never served unchecked."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.held: torch.Tensor | None = None  # the global scale a partial load delivered
        self.calls = 0  # tensors delivered since the last finish (``finish_load``)
        self.fresh_scale = False  # the engine loaded the global scale since the last finish
        self.files = False  # the load reads the table from its files (``note_files``)
        self.compared: MappedTable | None = None  # the table the shards in ``names`` were compared with

    def note(self, index: int, kind: str, table: MappedTable) -> None:
        """``compare_shard``'s ``index`` and ``kind`` delivered in memory, found equal to ``table``'s;
        the shards found equal to another table before are forgotten."""
        if table is not self.compared:
            self.names, self.compared = self._not_shards(), table
        self.names.add("scale" if kind == "weight_scale_2" else f"shard_{index}.{kind}")
        self.calls += 1

    def _not_shards(self) -> set[str]:
        return {name for name in self.names if not name.startswith("shard_")}

    def note_scale(self) -> None:
        self.names.add("scale")
        self.calls += 1
        self.fresh_scale = True

    def note_files(self) -> None:
        self.files = True
        self.calls += 1

    def clear(self) -> None:
        self.names.clear()
        self.held, self.calls, self.fresh_scale, self.files = None, 0, False, False
        self.compared = None

    def lacking(self, table: MappedTable) -> list[str]:
        """What of ``table`` the load has not delivered: each shard's rows, an NVFP4 table's block
        scales, its global scale where it has one, as ``shard_<i>.<kind>`` and ``scale``; shards
        compared with another table count as not delivered."""
        got = self.names if table is self.compared else self._not_shards()
        layout = table.layout
        kinds = ("weight", "weight_scale") if layout.has_block_scales else ("weight",)
        whole = [f"shard_{i}.{kind}" for i in range(layout.parts) for kind in kinds]
        if table.scale is not None:
            whole.append("scale")
        return [name for name in whole if name not in got]

    def partial(self, table: MappedTable) -> bool:
        """Whether the load delivered some shard tensor of ``table`` in memory but not every one of its
        tensors: each shard's rows, an NVFP4 table's block scales, its global scale where it has one.
        Never a load from the files (``note_files``)."""
        if self.files:
            return False
        return any(name.startswith("shard_") for name in self.names) and bool(self.lacking(table))


def finish_load(layer) -> None:
    """After a load (or one call of it), for an engine's ``ServedLayer``: its table is open
    (``ensure_table``: a new one staged), and the global scale the engine loaded
    (``layer.global_scale()``) is the table's; then the table serves. A refusal, or a table that
    cannot open, ends the load as a failed one (``abandon_load``) and raises. Shared by both
    engines' layers; ``finish_loads`` for every layer of one model's load."""
    if check_load(layer):
        layer.served.commit(layer.prefix)


def finish_loads(layers) -> None:
    """``finish_load`` for every ple-um layer of one model's load: each layer's new table is checked
    first, and only once all of them pass do they serve; one refused (or a KeyboardInterrupt) ends
    the load of every layer as a failed one, each old table serving on with its own scale."""
    layers = list(layers)
    try:
        ready = [layer for layer in layers if check_load(layer)]
    except BaseException:
        for layer in layers:
            abandon_load(layer)
        raise
    for layer in ready:
        layer.served.commit(layer.prefix)


def load_model(layers, load):
    """``load()``: one model's load (or one call of a weight sync) that reaches ``layers`` (their
    tensors in several calls, in any order), and returns what it returns. Meanwhile each layer's
    ``in_model_load`` is set: the arrival of its tensors finishes nothing. At its end
    ``finish_loads`` checks every layer's new table before any serves; a load that fails, wherever
    in the engine's loader, ends as a failed one for every layer (``abandon_load``), so that nothing
    it delivered carries over to the next load."""
    layers = list(layers)
    for layer in layers:
        layer.in_model_load = True
    try:
        result = load()
    except BaseException:
        for layer in layers:
            abandon_load(layer)
        raise
    finally:
        for layer in layers:
            layer.in_model_load = False
    finish_loads(layers)
    return result


def check_load(layer) -> bool:
    """The checks of ``finish_load``: True when the table may serve (``commit``). A new table stays
    staged, the old one serving with its own global scale, while the load delivered only part of it
    in memory (``Deliveries.partial``): the call that completes it checks it (against the global
    scale the sync delivered, held meanwhile) and returns True, and so does a load from the table's
    files (``Deliveries.note_files``), a reload that brings all of it. A call that delivered nothing
    of it ends the sync without its rest: the staged table is closed, said in the log."""
    name, scale, expected = layer.global_scale()
    try:
        table, deliveries = layer.ensure_table(), layer.deliveries()
        if layer.served.staged is not None and deliveries.partial(table):
            lacks = ", ".join(deliveries.lacking(table))
            if deliveries.calls == 0:
                layer.served.logger.warning(
                    "ple-um: %s: the load delivered nothing more of the new table in %s in memory; "
                    "it lacked %s: closed, the old table serves on",
                    layer.prefix,
                    table.layout.directory,
                    lacks,
                )
                abandon_load(layer)
                return False
            if deliveries.fresh_scale and scale is not None:
                deliveries.held = scale.detach().clone()
            _restore_scale(layer)
            deliveries.calls, deliveries.fresh_scale = 0, False
            layer.served.logger.info(
                "ple-um: %s: the new table in %s stays staged, the old one serving, until the load "
                "delivers the rest of it in memory: %s",
                layer.prefix,
                table.layout.directory,
                lacks,
            )
            return False
        if deliveries.held is not None and not deliveries.fresh_scale and scale is not None:
            with torch.no_grad():
                scale.copy_(deliveries.held)
        deliveries.clear()
        want = None if scale is None else expected(table)
        if want is not None:
            layer.served.check_scale(layer.prefix, name, scale, want, table)
    except BaseException:
        abandon_load(layer)
        raise
    return True


def layer_stats(layer, sync: bool = True) -> dict:
    """An engine's ``ServedLayer.stats()``: the serving table's ``MappedTable.stats`` (none before a
    table is open), and ``staged``: a new table a weight sync delivered only part of, which does not
    serve yet, as its ``directory`` and what of it the sync ``lacks`` (``Deliveries.lacking``:
    ``shard_<i>.<kind>``, ``scale``), or None."""
    table, staged = layer.served.table, layer.served.staged
    found = table.stats(sync=sync) if table is not None else {}
    lacks = (
        None if staged is None else {"directory": staged[1], "lacks": layer.deliveries().lacking(staged[0])}
    )
    return {**found, "staged": lacks}


def abandon_load(layer) -> None:
    """A load of ``layer`` failed: the table it staged is closed, what it delivered forgotten, and the
    old table serves on with its own global scale, set back where the engine had already copied the
    failed load's into the layer."""
    layer.served.discard()
    layer.deliveries().clear()
    _restore_scale(layer)


def _restore_scale(layer) -> None:
    """The layer's global scale set back to the serving table's, where there are both."""
    _, scale, expected = layer.global_scale()
    serving = layer.served.table
    if serving is not None and scale is not None and (old := expected(serving)) is not None:
        with torch.no_grad():
            scale.fill_(old)
