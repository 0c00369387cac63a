"""Fixtures shared by the tests: small synthetic checkpoints written to tmp_path.

The reference readers and the byte-level safetensors writers live in ``tests/reference.py``
(``from reference import reference_rows``), so that any test module can import them.

The GPU paths (the ats and device modes, the Triton kernel, the self-test) run on the CPU under
the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before triton is imported (the kernels
are decorated at import), so it is set here, at import time. A kernel then reads the mmap's host
addresses directly, and ``read_capabilities("cpu")`` reports ``host_is_device=True``.
"""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (ple_um below)
sys.path.insert(0, os.path.dirname(__file__))  # `from reference import ...`, whatever the import mode

from reference import reference_rows  # noqa: E402

from ple_um.synthetic import write_checkpoint  # noqa: E402

__all__ = ["reference_rows"]

VLLM_TESTS = pathlib.Path(__file__).parent / "vllm"


def pytest_addoption(parser):
    group = parser.getgroup("ple-um")
    group.addoption(
        "--differential-cases",
        type=int,
        default=None,
        metavar="N",
        help="cases of test_checkpoint_differential.py, the fuzzing against safetensors (400 in CI)",
    )
    group.addoption(
        "--differential-seed", type=int, default=None, metavar="S", help="the seed of those cases (default 0)"
    )


@pytest.fixture(autouse=True)
def _cpu_only_host_for_vllm(request, monkeypatch):
    """The vLLM tests model a CPU-only host, whose only mode is cpu: without the interpreter's
    variable the probe no longer sees the host as a device (the kernels stay interpreted)."""
    if VLLM_TESTS in request.node.path.parents:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


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
def layout(make_checkpoint, rng):
    """FP8, 120 rows of 10 in 5 shards of 24 over 4 files (the last one's data 4 mod 8), fresh
    random data. Modules that need another table override it."""
    return make_checkpoint(num_rows=120, row_dim=10, dtype="fp8", shards=5, seed=int(rng.integers(1 << 30)))


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


@pytest.fixture
def rng(request):
    """A generator with a fresh seed for each test; the seed is printed (pytest shows it on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{request.node.nodeid}: seed {seed}")
    return np.random.default_rng(seed)


def _poison(out: torch.Tensor) -> torch.Tensor:
    out.view(torch.uint8).fill_(0xAB)
    return out


def _expected_rows(layout, ids, out_dtype: torch.dtype | None = None, rows=None) -> torch.Tensor:
    shape = (*np.shape(np.asarray(ids)), layout.row_dim)
    data = reference_rows(layout, ids, rows)
    raw = torch.zeros(data.shape, dtype=torch.uint8)  # (from_numpy of an empty array cannot be viewed)
    raw.numpy()[...] = data
    raw = raw.view(layout.dtype).reshape(shape)
    if out_dtype is None or out_dtype == layout.dtype:
        return raw
    value = raw.float()
    if layout.scale is not None:
        value = value * torch.tensor(layout.scale, dtype=torch.float32)
    return value.to(out_dtype)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _assert_same_bits(got: torch.Tensor, expect: torch.Tensor, *, raw: bool = True) -> None:
    assert got.shape == expect.shape and got.dtype == expect.dtype, (got.shape, got.dtype, expect.shape)
    got, expect = got.detach().cpu(), expect.detach().cpu()
    view = _INT_VIEW[got.element_size()]
    g, e = got.contiguous().view(view), expect.contiguous().view(view)
    if not raw:
        nan = torch.isnan(expect)
        assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
        g, e = g[~nan], e[~nan]
    bad = (g != e).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} elements differ, first at {bad[:4].tolist()}"


@pytest.fixture
def poison():
    """``poison(out)``: fill ``out`` with 0xAB bytes (no row of a test table is all 0xAB) and return it."""
    return _poison


@pytest.fixture
def expected_rows():
    """``expected_rows(layout, ids, out_dtype=None, rows=None)``: what a lookup must return, from the
    reference reader: ``ids.shape + (row_dim,)``, raw in the storage dtype, or dequantized to
    ``out_dtype`` as ``float32(row) * scale`` cast; zeros outside ``rows`` and outside the table."""
    return _expected_rows


@pytest.fixture
def assert_same_bits():
    """``assert_same_bits(got, expect, raw=True)``: equal shape, dtype and bits, element by element.
    Raw rows are compared byte for byte; in dequantized ones (``raw=False``) a NaN need only be a
    NaN: its payload and sign are unspecified."""
    return _assert_same_bits


@pytest.fixture
def check_rows():
    """``check_rows(got, layout, ids, rows=None)``: assert that ``got`` is exactly the lookup of
    ``ids``: raw when its dtype is the storage dtype, else dequantized (see ``assert_same_bits``)."""

    def check(got: torch.Tensor, layout, ids, rows=None) -> None:
        ids = ids.cpu() if isinstance(ids, torch.Tensor) else ids
        expect = _expected_rows(layout, ids, got.dtype, rows)
        _assert_same_bits(got, expect, raw=got.dtype == layout.dtype)

    return check
