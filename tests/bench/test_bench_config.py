"""The bench's table and its fit to the machine: the synthetic table written once, a partial one
never left or used, the largest file's size as written, the memory a run holds."""

from __future__ import annotations

import os

import pytest

from ple_um.bench import config
from ple_um.units import format_bytes


def test_the_table_is_written_once_and_a_stale_partial_one_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path))
    cfg = config.Config(size=1 << 20, shards=8)
    path = config.table_path(cfg)
    stale = path + ".partial"
    os.makedirs(stale)
    (tmp_path / os.path.basename(stale) / "model-00001-of-00004.safetensors").write_bytes(b"half")
    assert config.default_table(cfg, progress=False) == path
    assert not os.path.exists(stale)
    files = sorted(os.listdir(path))
    assert files[-1] == "model.safetensors.index.json" and len(files) == 5
    stamp = os.stat(os.path.join(path, files[0])).st_mtime_ns
    assert config.default_table(cfg, progress=False) == path  # already written: not again
    assert os.stat(os.path.join(path, files[0])).st_mtime_ns == stamp


@pytest.mark.parametrize("size,shards", [(1 << 20, 8), (3 << 20, 7), (1 << 20, 2), (5 << 20, 128)])
def test_largest_file_bytes_covers_the_largest_file_written(tmp_path, monkeypatch, size, shards):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path))
    cfg = config.Config(size=size, shards=shards)
    path = config.default_table(cfg, progress=False)
    largest = max(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    assert largest <= config.largest_file_bytes(cfg) <= largest + (64 << 10)


def test_check_disk_passes_a_table_that_fits_and_one_already_written(tmp_path, monkeypatch):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "not" / "yet"))
    config.check_disk(config.Config(size=1 << 20, shards=8))  # the nearest folder that exists is asked
    with pytest.raises(config.BenchRefused, match="does not fit the free disk of"):
        config.check_disk(config.Config(size=1 << 62, shards=8))


def test_memory_needed_names_what_holds_it():
    T = 10 << 30
    cpu = config.memory_needed(T, cuda=False, modes=("cpu",))
    assert cpu["host"] == {
        "the table in the page cache": T,
        "the run itself": config.RUN_OVERHEAD_BYTES,
        "the torch anchor's copy": T,
    }
    assert cpu["gpu"] == {}
    gpu = config.memory_needed(T, cuda=True, modes=("registered", "device"))
    assert gpu["host"]["vllm pinned-host's copy"] == T and "the torch anchor's copy" not in gpu["host"]
    assert gpu["gpu"] == {"the torch anchor's copy": T, "the device mode's copy": T}
    assert config.memory_needed(T, cuda=True, modes=("cpu",))["gpu"] == {"the torch anchor's copy": T}
    assert config.memory_needed(T, cuda=True, modes=("cpu",), processes=3)["host"] == {
        "the table in the page cache": T,
        "the run itself": config.RUN_OVERHEAD_BYTES,
        "vllm pinned-host's copies in 3 processes": 3 * T,
    }
    assert config.memory_needed(T, cuda=False, modes=("cpu",), processes=3) == cpu
    nvfp4 = config.memory_needed(T, cuda=True, modes=("cpu",), nvfp4=True)
    assert nvfp4["gpu"] == {} and set(nvfp4["host"]) == {"the table in the page cache", "the run itself"}


def test_check_memory_refuses_with_the_figures():
    T = 4 << 30
    needed = config.memory_needed(T, cuda=True, modes=("device",))
    config.check_memory(needed, host_available=2 * T + config.RUN_OVERHEAD_BYTES, gpu_free=2 * T)
    with pytest.raises(config.BenchRefused) as info:
        config.check_memory(needed, host_available=2 * T, gpu_free=None)
    total = format_bytes(2 * T + config.RUN_OVERHEAD_BYTES)
    assert str(info.value).startswith(
        f"the run would hold {total} of host memory (the table in the page cache"
    )
    assert f"more than MemAvailable ({format_bytes(2 * T)})" in str(info.value)
    with pytest.raises(
        config.BenchRefused, match=r"of gpu memory .* more than the GPU's free memory \(4.00 GiB\)"
    ):
        config.check_memory(needed, host_available=1 << 40, gpu_free=T)
