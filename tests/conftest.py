"""Fixtures shared by the tests: small synthetic checkpoints written to tmp_path.

Shared helpers live in the ``tests/helpers`` package (``from helpers.reference import
reference_rows``; this file puts ``tests/`` and the lab's ``tools/`` on ``sys.path``): the
reference readers and the byte-level safetensors writers, the injected machines, the C row copy's
job structs. No test module imports another. Every knob of ``ple_um.envs`` is cleared before each
test (``_default_knobs``), so a test sees the defaults unless it sets a knob itself.

The GPU paths (the ats and device modes, the Triton kernel, the self-test) run on the CPU under
the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before triton is imported (the kernels
are decorated at import), so it is set here, at import time. A kernel then reads the mmap's host
addresses directly, and ``read_capabilities("cpu")`` reports ``host_is_device=True``. A run that
selects the GPU tests (``python -m pytest -m gpu``, tests/gpu) leaves the interpreter off.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys

import numpy as np
import pytest
import torch


def _gpu_session() -> bool:
    """``python -m pytest -m gpu`` (tests/gpu): the kernels are compiled for the device, not interpreted."""
    args = sys.argv[1:]
    for k, arg in enumerate(args):
        expression = (
            args[k + 1] if arg == "-m" and k + 1 < len(args) else arg[2:] if arg.startswith("-m") else ""
        )
        if "gpu" in expression and "not gpu" not in expression:
            return True
    return False


if not _gpu_session():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (ple_um below)
sys.path.insert(0, os.path.dirname(__file__))  # `from helpers... import`, whatever the import mode
# The lab beside the package (tools/: simulators, trace making, profilers) is not installed; its
# modules import each other by name, as when a tool runs as `python tools/NAME.py`.
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from helpers.reference import bits_differ, reference_rows  # noqa: E402

from ple_um import envs  # noqa: E402
from ple_um.synthetic import write_checkpoint  # noqa: E402

__all__ = ["reference_rows"]

VLLM_TESTS = pathlib.Path(__file__).parent / "vllm"


@pytest.fixture(autouse=True, scope="session")
def _session_cache_dir(tmp_path_factory):
    """PLE_UM_CACHE_DIR in a folder of this session unless the caller set one: the first-read
    verdicts the tests cause (an injected failure among them) must not outlive the run in
    ~/.cache/ple-um, where a later run or a server would trust them."""
    if "PLE_UM_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["PLE_UM_CACHE_DIR"] = str(tmp_path_factory.mktemp("ple-um-cache"))
    yield
    os.environ.pop("PLE_UM_CACHE_DIR", None)


# Knobs a test run keeps: the session's cache folder (above), or the caller's.
_KEPT_KNOBS = ("PLE_UM_CACHE_DIR",)


@pytest.fixture(autouse=True)
def _default_knobs(monkeypatch):
    """Every knob of ``ple_um.envs`` (and its seed aliases) unset, but the cache folder: a knob
    exported in the shell that runs the tests cannot change what they see."""
    for knob in envs.KNOBS.values():
        if knob.name not in _KEPT_KNOBS:
            for var in (knob.name, *knob.aliases):
                monkeypatch.delenv(var, raising=False)


@pytest.fixture
def machine():
    """``machine(caps=H200, register=True, **failures) -> InjectedRegistration``: from the call to
    the end of the test, open_table sees ``caps`` and registers through the injection
    (``helpers.machines.injected_machine``)."""
    from helpers.machines import H200, injected_machine

    with contextlib.ExitStack() as stack:
        yield lambda caps=H200, **kw: stack.enter_context(injected_machine(caps, **kw))


def pytest_sessionstart(session):
    """vLLM decides at its first import whether Triton is usable; on a host without a GPU it swaps
    ``triton.jit`` for a placeholder, unless its devices look hidden. Its first import in the
    session is made here, that way, so that every test that runs a vLLM Triton kernel under the
    interpreter (the Engram lookup) gets the real one, whichever test imports vLLM first."""
    if not _gpu_session():
        from helpers.vllm_engram import import_vllm_with_real_triton

        import_vllm_with_real_triton()


def pytest_addoption(parser):
    group = parser.getgroup("ple-um")
    group.addoption(
        "--differential-cases",
        type=int,
        default=None,
        metavar="N",
        help="cases of tests/checkpoint/test_differential.py, the fuzzing against safetensors (400 in CI)",
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


def _assert_same_bits(got: torch.Tensor, expect: torch.Tensor, *, raw: bool = True) -> None:
    why = bits_differ(got, expect, raw=raw)
    assert why is None, why


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


class LoadWatch:
    """The loads the Triton interpreter makes while watched: for each load, the width of its
    elements in bits and the addresses it reads (masked-off lanes left out). A GPU faults on a
    load whose address is not a multiple of its width and the interpreter does not, so tests read
    the widths and addresses of the launch here instead."""

    def __init__(self) -> None:
        self.loads: list[tuple[int, np.ndarray]] = []

    def _seen(self) -> list[tuple[int, np.ndarray]]:
        # Nothing seen means the hook no longer reaches the interpreter's loads: fail, never pass.
        assert self.loads, "no kernel load was seen (the interpreter hook no longer applies)"
        return self.loads

    def misaligned(self) -> list[tuple[int, int]]:
        """(bits, first address) of each load some address of which is not a multiple of its width."""
        return [
            (bits, int(a[a % (bits // 8) != 0][0])) for bits, a in self._seen() if (a % (bits // 8)).any()
        ]

    def row_widths(self, bases, mapping) -> set[int]:
        """Widths of the loads that read the owned rows of ``mapping`` through per-shard ``bases``
        (addresses of each shard's local row 0, as the kernel receives them: a list or a tensor)."""
        bases = [int(b) for b in bases]
        rb = mapping.layout.row_bytes
        ranges = [(bases[i] + o.lo * rb, bases[i] + o.hi * rb) for i, o in mapping.owned.items()]
        return {bits for bits, a in self._seen() if any(((a >= lo) & (a < hi)).any() for lo, hi in ranges)}

    def clear(self) -> None:
        self.loads.clear()


@pytest.fixture
def watch_loads(monkeypatch):
    """A ``LoadWatch`` of every load the Triton interpreter makes during the test."""
    from triton.runtime import interpreter

    watch = LoadWatch()
    builder = interpreter.interpreter_builder
    load = builder.create_masked_load

    def watched(ptrs, mask, *args, **kwargs):
        addrs = np.asarray(ptrs.data).astype(np.uint64)
        lanes = np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape)
        watch.loads.append((ptrs.get_element_ty().primitive_bitwidth, addrs[lanes]))
        return load(ptrs, mask, *args, **kwargs)

    monkeypatch.setattr(builder, "create_masked_load", watched)
    return watch


@pytest.fixture
def check_rows():
    """``check_rows(got, layout, ids, rows=None)``: assert that ``got`` is exactly the lookup of
    ``ids``: raw when its dtype is the storage dtype, else dequantized (see ``assert_same_bits``)."""

    def check(got: torch.Tensor, layout, ids, rows=None) -> None:
        ids = ids.cpu() if isinstance(ids, torch.Tensor) else ids
        expect = _expected_rows(layout, ids, got.dtype, rows)
        _assert_same_bits(got, expect, raw=got.dtype == layout.dtype)

    return check
