"""tools/tp_check.py, the two-GPU tensor-parallel check, run here as its CPU dry run: two
processes, gloo, the cpu mode, a 32 MiB table; every check it runs must pass, and the ones that
need a GPU must say why they were skipped. Also its pieces that need no run: the vocab split
against vLLM's, and the pinned span it expects against the regions ple_um maps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.reference import reference_rows
from helpers.tools import TOOLS, load_tool

from ple_um.checkpoint import read_layout
from ple_um.mapping import MappedShards
from ple_um.synthetic import write_checkpoint

SCRIPT = TOOLS / "tp_check.py"
IDS = (1024, 4096)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_check")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PLE_UM_MODE", "PLE_UM_PREWARM")}
    env["PLE_UM_CACHE_DIR"] = str(tmp)
    out = tmp / "tp_check.json"
    command = [sys.executable, str(SCRIPT), "--backend", "gloo", "--device", "cpu", "--size", "32MiB"]
    command += ["--ids", ",".join(map(str, IDS)), "--repeats", "2", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_dry_run_passes_every_check(dry_run):
    proc, result = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert result["passed"] and result["counts"]["FAIL"] == 0
    names = {(c["rank"], c["name"]) for c in result["checks"] if c["status"] == "PASS"}
    for rank in (0, 1):
        expected = [
            "vocab split falls inside shards",
            "cpu/cpu: pinned bytes == the span of the shards its rows touch",
            "cpu/cpu: anonymous memory but the row cache grew by less than a quarter of its rows (no copy)",
            "cpu/cpu: device counters count every lookup",
        ]
        for n in IDS:
            for kind in ("uniform", "with bad ids and the split's edges"):
                expected += [
                    f"cpu/cpu: {n} ids {kind}, all_reduce(fp8 as int8) == file rows (bytes)",
                    f"cpu/cpu: {n} ids {kind}, all_reduce(bf16) == file rows (values)",
                ]
            expected += [
                f"cpu/cpu: eager {n} ids {out}: 3 timed steps == file rows" for out in ("fp8 as int8", "bf16")
            ]
        assert [name for name in expected if (rank, name) not in names] == []
    assert (0, "cpu/cpu: host memory grew by one table for all ranks (page cache shared)") in names


def test_dry_run_says_why_it_skipped(dry_run):
    _, result = dry_run
    skipped = {(c["name"], c["detail"]) for c in result["checks"] if c["status"] == "SKIP"}
    assert skipped == {
        ("registered/registered: whole run", "registered needs a CUDA device (dry run: cpu mode only)"),
        ("registered/cpu: whole run", "registered needs a CUDA device (dry run: cpu mode only)"),
        (
            "cpu/cpu: CUDA graph of lookup + all_reduce, replays with new ids == file rows",
            "CUDA graphs need a CUDA device (dry run on the CPU)",
        ),
    }


def test_dry_run_reports_split_memory_and_times(dry_run):
    proc, result = dry_run
    table = result["table"]
    rows = table["num_rows"]
    assert rows % 64 == 0 and table["ranges"] == [[0, rows // 2], [rows // 2, rows]]
    assert (rows // 2) % -(-rows // table["shards"])  # the split lies inside a shard
    mem = result["memory"]["cpu/cpu"]
    assert [r["pinned_bytes"] for r in mem["ranks"]] == [0, 0]
    assert [r["owned_bytes"] for r in mem["ranks"]] == [rows // 2 * 160] * 2
    assert {"RssAnon", "RssFile"} <= set(mem["ranks"][0]["growth"])
    assert {"Cached", "TableCached"} <= set(mem["system"]["growth"])
    timed = {(t["modes"], t["rank"], t["ids"], t["out"], t["how"]) for t in result["timings"]}
    for n in IDS:
        for out in ("fp8 as int8", "bf16"):
            assert {("cpu/cpu", 0, n, out, "eager"), ("cpu/cpu", 1, n, out, "eager")} <= timed
            assert ("one process, whole table, no all-reduce", 0, n, out, "eager") in timed
    assert all(t["calls"] == 2 and t["median_us"] > 0 for t in result["timings"])
    tail = proc.stdout.rstrip().splitlines()
    last = [line for line in tail if not line.startswith("[tp_check")][-1]
    assert last.startswith("| one process, whole table, no all-reduce | 4096 | bf16 |")
    assert "tp_check: " in proc.stdout and " 0 failed" in proc.stdout


@pytest.mark.parametrize("rows", [64 * 1000, 64 * 1001, 64 * 4097])
def test_vocab_split_is_vllms(rows):
    vocab = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")
    tp = load_tool("tp_check")
    for world in (1, 2, 4):
        got = tp.vocab_ranges(rows, world)
        for rank in range(world):
            padded = vocab.pad_vocab_size(rows, tp.VOCAB_PADDING)
            idx = vocab.VocabParallelEmbedding._get_indices(padded, padded, rows, rows, rank, world)
            assert got[rank] == (idx.org_vocab_start_index, idx.org_vocab_end_index)


def test_table_shape_moves_the_split_off_shard_boundaries():
    tp = load_tool("tp_check")
    for size, shards in [(128 * 64 * 160, 128), (16 << 30, 128), (32 << 20, 128), (8 << 30, 127)]:
        rows = tp.table_shape(size, 160, shards, 2)
        assert rows % 64 == 0 and 0 <= size // 160 - rows < 64 * 3
        assert tp.vocab_ranges(rows, 2)[1][0] % -(-rows // shards)
    with pytest.raises(ValueError, match="pick another --shards"):
        tp.table_shape(8 << 30, 160, 64, 2)  # 64 shards divide every multiple of 64 rows evenly


def test_file_table_and_pinned_span_agree_with_ple_um(tmp_path, rng):
    tp = load_tool("tp_check")
    layout = write_checkpoint(tmp_path, num_rows=6400, row_dim=160, dtype="fp8", shards=13, files=3, seed=4)
    files = tp.FileTable(str(tmp_path))
    assert (files.num_rows, files.row_bytes, files.parts, files.scale) == (6400, 160, 13, layout.scale)
    ids = rng.integers(0, 6400, 500)
    whole = files.load(torch.device("cpu")).numpy()
    assert np.array_equal(whole[ids], reference_rows(read_layout(str(tmp_path)), ids))
    S = layout.rows_per_shard
    for start, end in [(0, 3200), (3200, 6400), (S - 1, 5 * S + 7), (0, 6400), (6399, 6400)]:
        mapping = MappedShards(layout, (start, end))
        try:
            span, touched = files.pinned_span(start, end)
            assert span == mapping.mapped_bytes and touched == sorted(mapping.owned)
        finally:
            mapping.close()
