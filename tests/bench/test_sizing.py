"""Whether a bench run fits this machine: the synthetic table's largest file as written, the disk
it needs, the memory a run holds and its refusal with the figures."""

from __future__ import annotations

import os

import pytest

from ple_um.bench import config, sizing
from ple_um.units import format_bytes


@pytest.mark.parametrize("size,shards", [(1 << 20, 8), (3 << 20, 7), (1 << 20, 2), (5 << 20, 128)])
def test_largest_file_bytes_covers_the_largest_file_written(tmp_path, monkeypatch, size, shards):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path))
    cfg = config.Config(size=size, shards=shards)
    path = config.default_table(cfg, progress=False)
    largest = max(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    assert largest <= sizing.largest_file_bytes(cfg) <= largest + (64 << 10)


def test_check_disk_passes_a_table_that_fits_and_one_already_written(tmp_path, monkeypatch):
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path / "not" / "yet"))
    sizing.check_disk(config.Config(size=1 << 20, shards=8))  # the nearest folder that exists is asked
    with pytest.raises(sizing.BenchRefused, match="does not fit the free disk of"):
        sizing.check_disk(config.Config(size=1 << 62, shards=8))


def test_memory_needed_names_what_holds_it():
    T = 10 << 30
    cpu = sizing.memory_needed(T, cuda=False, modes=("cpu",))
    assert cpu["host"] == {
        "the table in the page cache": T,
        "the run itself": sizing.RUN_OVERHEAD_BYTES,
        "the torch anchor's copy": T,
    }
    assert cpu["gpu"] == {}
    gpu = sizing.memory_needed(T, cuda=True, modes=("registered", "device"))
    assert gpu["host"]["vllm pinned-host's copy"] == T and "the torch anchor's copy" not in gpu["host"]
    assert gpu["gpu"] == {"the torch anchor's copy": T, "the device mode's copy": T}
    assert sizing.memory_needed(T, cuda=True, modes=("cpu",))["gpu"] == {"the torch anchor's copy": T}
    assert sizing.memory_needed(T, cuda=True, modes=("cpu",), processes=3)["host"] == {
        "the table in the page cache": T,
        "the run itself": sizing.RUN_OVERHEAD_BYTES,
        "vllm pinned-host's copies in 3 processes": 3 * T,
    }
    assert sizing.memory_needed(T, cuda=False, modes=("cpu",), processes=3) == cpu
    nvfp4 = sizing.memory_needed(T, cuda=True, modes=("cpu",), nvfp4=True)
    assert nvfp4["gpu"] == {} and set(nvfp4["host"]) == {"the table in the page cache", "the run itself"}


def test_check_memory_refuses_with_the_figures():
    T = 4 << 30
    needed = sizing.memory_needed(T, cuda=True, modes=("device",))
    sizing.check_memory(needed, host_available=2 * T + sizing.RUN_OVERHEAD_BYTES, gpu_free=2 * T)
    with pytest.raises(sizing.BenchRefused) as info:
        sizing.check_memory(needed, host_available=2 * T, gpu_free=None)
    total = format_bytes(2 * T + sizing.RUN_OVERHEAD_BYTES)
    assert str(info.value).startswith(
        f"the run would hold {total} of host memory (the table in the page cache"
    )
    assert f"more than MemAvailable ({format_bytes(2 * T)})" in str(info.value)
    with pytest.raises(
        sizing.BenchRefused, match=r"of gpu memory .* more than the GPU's free memory \(4.00 GiB\)"
    ):
        sizing.check_memory(needed, host_available=1 << 40, gpu_free=T)


def test_a_refusal_names_the_options_of_its_own_run(tmp_path, monkeypatch):
    """--serving takes no --rows (its lookups are a decode step's and a prefill chunk's): a refusal
    of it names its lookups by what they are and --prefill-tokens, the option that shrinks them; a
    run under --memory-limit holds no copy of the table: --size is not what to shrink."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path))
    limited = config.Config(serving=True, memory_limits=(1 << 20,), size=1 << 20)
    with pytest.raises(sizing.BenchRefused) as info:
        sizing.check_fits(limited, None, True, None)
    prefill = 16 * config.PREFILL_TOKENS
    assert f"the serving step's lookup of {prefill} ids: the ids drawn ahead" in str(info.value)
    assert str(info.value).endswith("or fewer --prefill-tokens")
    with pytest.raises(sizing.BenchRefused) as info:
        sizing.check_fits(config.Config(serving=True, size=1 << 20), None, True, 1 << 20)
    assert str(info.value).endswith("give a smaller --size or --prefill-tokens")
    assert "--rows" not in str(info.value)
    # Under --memory-limit the child holds no copy of the table: its batches are what to shrink.
    huge = config.Config(memory_limits=(1 << 62,), rows=(1 << 40,), size=1 << 20)
    with pytest.raises(sizing.BenchRefused) as info:
        sizing.check_fits(huge, None, False, None)
    assert str(info.value).endswith("give smaller --rows or --repeats")
