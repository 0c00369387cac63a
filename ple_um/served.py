"""ServedTable: the table a serving framework's layer reads (the vLLM backend, the SGLang embedding).

Both plugins hold one table per layer: this rank's rows of the checkpoint's table, opened when the
weights are loaded and opened again when a later load names another checkpoint directory. What
they share is here: the new table checked before it replaces the old one (closed when a check
refuses it), the old one closed as soon as the new one serves (``MappedTable.close`` waits for
the lookups already under way), and the open's log line, at INFO with
the probe's report for the first layer a plugin opens in the process and at DEBUG for the rest.
What each framework checks before and after the open stays with its plugin.

``SideLookups`` is the other shared part: the side stream that the early lookups of a step are
queued on, and the per-layer marks each layer's rows are joined by.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from ple_um.lookup.streams import own_stream
from ple_um.table import MappedTable

# The loggers (by name) that have written the INFO line of an open in this process.
_reported: set[str] = set()


class ServedTable:
    """A layer's open table (``table``, or None) and the checkpoint directory it was opened from;
    ``logger`` is the plugin's."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.table: MappedTable | None = None
        self.directory: str | None = None

    def open_at(self, directory: str) -> MappedTable | None:
        """The open table when it was opened from ``directory``, else None (none open, or another
        directory: the caller opens one)."""
        return self.table if self.table is not None and self.directory == directory else None

    def replace(
        self,
        prefix: str,
        directory: str,
        open_new: Callable[[], MappedTable],
        check: Callable[[MappedTable], None],
    ) -> MappedTable:
        """Open the table of ``directory`` (``open_new``), ``check`` it (a raise closes it and leaves
        the old one serving), then serve it in place of the old one, which is closed. ``prefix``
        names the layer in the log lines."""
        table = open_new()
        try:
            check(table)
        except BaseException:
            table.close()
            raise
        old, self.table, self.directory = self.table, table, directory
        if old is not None:
            self.logger.info("ple-um: %s remapped from %s to %s", prefix, old.layout.directory, directory)
            old.close()
        self._report(prefix, table)
        return table

    def _report(self, prefix: str, table: MappedTable) -> None:
        start, end = table.rows
        layout = table.layout
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
        """Close the table; idempotent."""
        table, self.table, self.directory = self.table, None, None
        if table is not None:
            table.close()


class SideLookups:
    """Lookups queued on one side stream of ple-um's own, forked from the current stream, each
    joined back on its own: the early lookups of a step (several layers' lookups started together,
    each taken where its layer needs the rows).

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
        event = self._marks.get(key)
        if event is None:
            event = self._marks[key] = torch.cuda.Event()
        event.record(self.stream)

    def join(self, key: object, device: torch.device) -> None:
        """The current stream waits for ``key``'s mark."""
        torch.cuda.current_stream(device).wait_event(self._marks[key])
