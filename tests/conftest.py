"""Fixtures shared by the tests: small synthetic checkpoints written to tmp_path.

The reference readers and the byte-level safetensors writers live in ``tests/reference.py``
(``from reference import reference_rows``), so that any test module can import them.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `from reference import ...`, whatever the import mode

from reference import reference_rows  # noqa: E402

from ple_um.synthetic import write_checkpoint  # noqa: E402

__all__ = ["reference_rows"]


@pytest.fixture
def make_checkpoint(tmp_path):
    """``make_checkpoint(**write_checkpoint kwargs) -> ShardLayout`` in a fresh folder of tmp_path.

    Defaults: 37 rows of 24 elements in FP8 e4m3, 4 shards (10, 10, 10, 7), layer 1, seed 0.
    """
    count = 0

    def make(**kwargs):
        nonlocal count
        count += 1
        args = dict(num_rows=37, row_dim=24, dtype="fp8", shards=4)
        args.update(kwargs)
        return write_checkpoint(tmp_path / f"ckpt{count}", **args)

    return make


@pytest.fixture
def fp8_layout(make_checkpoint):
    return make_checkpoint()


@pytest.fixture
def bf16_layout(make_checkpoint):
    return make_checkpoint(dtype="bf16", num_rows=9, row_dim=8, shards=4, files=2)


@pytest.fixture(params=["F8_E4M3", "F8_E5M2", "BF16", "F16"])
def any_dtype_layout(request, make_checkpoint):
    """A small checkpoint of each storage dtype, with a trailing empty shard (9 rows in 4 parts)."""
    return make_checkpoint(dtype=request.param, num_rows=9, row_dim=6, shards=4, seed=3)
