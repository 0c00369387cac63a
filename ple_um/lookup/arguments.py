"""What a lookup accepts: the checks every lookup of a table makes on its arguments (``lookup``,
``lookup_packed`` and the torch ops), each failure a TypeError or ValueError saying what to pass."""

from __future__ import annotations

import torch

FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)
_ID_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8))


def check_ids(ids) -> None:
    """TypeError unless ``ids`` is a tensor of an integer dtype a lookup takes."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, not {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")


def check_args(table, ids, out: torch.Tensor | None, out_dtype) -> torch.dtype | None:
    """The argument checks of every lookup of ``table`` (``lookup`` and the torch ops); the out
    dtype."""
    check_ids(ids)
    if out is not None:
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(f"out is {out.dtype} but out_dtype is {out_dtype}: pass one of them")
        out_dtype = out.dtype
        if out_dtype not in table.out_dtypes:
            _refuse_dtype(table, out_dtype)
        if out.shape != (*ids.shape, table.row_dim):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {(*ids.shape, table.row_dim)}")
        if out.device != table.device:
            raise ValueError(f"out is on {out.device}, the table on {table.device}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    elif (out_dtype is not None and out_dtype not in table.out_dtypes) or (
        out_dtype is None and table.scale_mapping is not None
    ):
        _refuse_dtype(table, out_dtype)
    return out_dtype


def _refuse_dtype(table, out_dtype) -> None:
    if table.scale_mapping is not None:
        raise TypeError(
            f"an {table.layout.dtype_name} table decodes its rows: pass out_dtype (bf16, f16 or f32) "
            "or a float out=, or use lookup_packed() for the raw bytes and block scales"
        )
    raise TypeError(f"out_dtype must be {table.dtype} (raw) or one of bf16, f16, f32; got {out_dtype}")
