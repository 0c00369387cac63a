"""The GPU tests: the real kernels compiled for the device, real registration, real host nodes and
CUDA graphs, checked against rows read from the files. Run on a CUDA host with

    python -m pytest -m gpu

(the root conftest then leaves the Triton interpreter off). Everywhere else every test here is
skipped, with a reason that says so; the interpreter tests run as usual.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ple_um.synthetic import write_checkpoint


def _why_not() -> str | None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "the Triton interpreter is on: GPU tests run with `python -m pytest -m gpu` on a CUDA host"
    if not torch.cuda.is_available():
        return "no CUDA device: GPU tests run with `python -m pytest -m gpu` on a CUDA host"
    return None


def pytest_collection_modifyitems(config, items):
    why = _why_not()
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if why is not None:
                item.add_marker(pytest.mark.skip(reason=why))


# Tables written once per session: shard boundaries not aligned with anything, several files.
TABLES = {
    "fp8": dict(num_rows=200_003, row_dim=160, dtype="fp8", shards=13, files=4),
    "bf16": dict(num_rows=50_021, row_dim=80, dtype="bf16", shards=7, files=3),
    "f16": dict(num_rows=30_011, row_dim=96, dtype="f16", shards=5, files=2),
    "nvfp4": dict(num_rows=100_003, row_dim=160, dtype="nvfp4", shards=11, files=3),
}


@pytest.fixture(scope="session")
def tables(tmp_path_factory):
    """name -> ShardLayout of a real checkpoint written once (fresh seed per session)."""
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"GPU tables seed {seed}")
    made = {}
    for name, kw in TABLES.items():
        made[name] = write_checkpoint(tmp_path_factory.mktemp(name), seed=seed, **kw)
    return made


@pytest.fixture
def device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def ids_for():
    """``ids_for(layout, n, rng, rows=None)``: n random ids with every shard boundary, ids outside
    the table and (with rows) at the owned range's edges, shuffled; int64 numpy."""

    def make(layout, n, rng, rows=None):
        S, N = layout.rows_per_shard, layout.num_rows
        extra = [k * S + d for k in range(layout.parts + 1) for d in (-1, 0, 1)] + [-3, N, N + 7, 1 << 40]
        if rows is not None:
            extra += [rows[0] - 1, rows[0], rows[1] - 1, rows[1]]
        extra = extra[:n]
        ids = np.concatenate([extra, rng.integers(0, N, max(0, n - len(extra)))]).astype(np.int64)
        return rng.permutation(ids)

    return make
