"""The torch ops of a lookup: ``ple_um::lookup`` (returns rows) and ``ple_um::lookup_out`` (writes
into a given tensor, allocating nothing: what a CUDA graph captures).

Both are ``torch.library.custom_op``s with fake implementations, so torch.compile treats them as
opaque calls with known output shapes. An op receives the table as an integer handle; the table
registers itself here when it opens and leaves when it closes. The registry holds tables weakly: a
table dropped without ``close()`` is not kept alive by it (``ple_um.table`` releases it), and its
handle then raises ``TableClosedError`` like a closed one.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from ple_um.errors import TableClosedError

_TABLES: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()
_NEXT = itertools.count(1)


def register_table(table) -> int:
    with _LOCK:
        handle = next(_NEXT)
        _TABLES[handle] = table
    return handle


def unregister_table(handle: int) -> None:
    with _LOCK:
        _TABLES.pop(handle, None)


def _table(handle: int):
    table = _TABLES.get(handle)
    if table is None:
        raise TableClosedError(f"no open table has handle {handle} (closed?)")
    return table


@torch.library.custom_op("ple_um::lookup", mutates_args=())
def lookup(ids: torch.Tensor, handle: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows [n, row_dim] of flat ``ids``, in ``out_dtype`` (the storage dtype: raw)."""
    return _table(handle).op_lookup(ids, None, out_dtype)


@lookup.register_fake
def _(ids: torch.Tensor, handle: int, out_dtype: torch.dtype) -> torch.Tensor:
    # A symbolic int where torch.compile made the handle dynamic (one function over several
    # tables): int() specializes the graph on this table's handle.
    table = _table(int(handle))
    return torch.empty((ids.shape[0], table.row_dim), dtype=out_dtype, device=table.device)


@torch.library.custom_op("ple_um::lookup_out", mutates_args=("out",))
def lookup_out(ids: torch.Tensor, out: torch.Tensor, handle: int) -> None:
    """Rows of flat ``ids`` into ``out`` [n, row_dim]; raw when out has the storage dtype."""
    _table(handle).op_lookup(ids, out)


@lookup_out.register_fake
def _(ids: torch.Tensor, out: torch.Tensor, handle: int) -> None:
    return None
