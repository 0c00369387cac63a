"""tools/tp_check.py, the two-GPU tensor-parallel check, run here as its CPU dry run: two
processes, gloo, the cpu mode, a 32 MiB table looked up with the bench's uniform, zipf:1.1 and
trace ids, early lookups (the CPU form: no stream), a row cache pass, each rank under a memory
limit where a cgroup can be made here, and a 4 MiB Engram table split by heads; every check it runs
must pass, and the ones that need a GPU (or a cgroup) must say why they were skipped. Also its
pieces that need no run: the vocab split against vLLM's, the pinned span it expects against the
regions ple_um maps, the Engram head split, and the options it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from helpers.reference import reference_rows
from helpers.tools import TOOLS, load_tool

from ple_um.bench.memlimit import MemoryLimit
from ple_um.checkpoint import read_layout
from ple_um.mapping import MappedShards
from ple_um.synthetic import write_checkpoint

SCRIPT = TOOLS / "tp_check.py"
IDS = (1024, 4096)
DISTRIBUTIONS = ("uniform", "zipf:1.1", "trace")
LIMIT = 1 << 30  # each rank's memory limit: a rank of the dry run peaks near 100 MiB
SKIPPED_BY_GPU = "registered needs a CUDA device (dry run: cpu mode only)"
NO_GRAPHS = "CUDA graphs need a CUDA device (dry run on the CPU)"


@pytest.fixture(scope="module")
def cgroup():
    """Whether a memory cgroup can be made here, and why not."""
    probe = MemoryLimit.open(LIMIT, f"ple-um-probe-{os.getpid()}")
    probe.close()
    return probe.enforced, probe.why


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_check")
    drop = ("OUT", "PLE_UM_MODE", "PLE_UM_PREWARM", "PLE_UM_ROW_CACHE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PLE_UM_CACHE_DIR"] = str(tmp)
    out = tmp / "tp_check.json"
    command = [sys.executable, str(SCRIPT), "--backend", "gloo", "--device", "cpu", "--size", "32MiB"]
    command += ["--ids", ",".join(map(str, IDS)), "--repeats", "2", "--warmup", "1", "--out", str(out)]
    command += ["--row-cache", "8MiB", "--memory-limit", str(LIMIT), "--engram-size", "4MiB"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    return proc, json.loads(out.read_text()) if out.exists() else None


def _pairs(result, status: str) -> set[tuple[int, str]]:
    return {(c["rank"], c["name"]) for c in result["checks"] if c["status"] == status}


def test_dry_run_passes_every_check(dry_run, cgroup):
    proc, result = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert result["passed"] and result["counts"]["FAIL"] == 0
    names = _pairs(result, "PASS")
    tokens = [n // 8 for n in IDS]  # the Engram table's 8 heads: n ids are n / 8 tokens
    for rank in (0, 1):
        expected = ["vocab split falls inside shards"]
        for label in ("cpu/cpu", "cpu/cpu + row cache"):
            expected += [
                f"{label}: open rows={tuple(result['table']['ranges'][rank])} mode=cpu",
                f"{label}: pinned bytes == the span of the shards its rows touch",
                f"{label}: anonymous memory but the row cache grew by less than a quarter of its rows "
                "(no copy)",
                f"{label}: device counters count every lookup",
            ]
            for n in IDS:
                for kind in (*DISTRIBUTIONS, "with bad ids and the split's edges"):
                    expected += [
                        f"{label}: {n} ids {kind}, all_reduce(fp8 as int8) == file rows (bytes)",
                        f"{label}: {n} ids {kind}, all_reduce(bf16) == file rows (values)",
                    ]
                for out in ("fp8 as int8", "bf16"):
                    expected += [
                        f"{label}: eager {n} ids {out}: 3 timed steps == file rows",
                        f"{label}: early lookups, eager {n} ids {out}: 3 steps (the first with bad ids), "
                        "forked at the step's start, joined where used == file rows",
                    ]
        expected.append(
            "cpu/cpu + row cache: the row cache and the reader of misses served (hits, misses, file reads)"
        )
        heads = result["engram"][rank]["heads"]
        rows = result["engram"][rank]["rows"]
        expected.append(f"engram cpu: open heads {heads} = rows {rows} mode=cpu")
        expected += [
            f"engram cpu: {t} tokens x 8 heads, all_gather(bf16) == file rows (bits)" for t in tokens
        ]
        if cgroup[0]:
            expected.append("memory limit: this rank in a memory cgroup of its own of 1.00 GiB")
        assert [name for name in expected if (rank, name) not in names] == []
    assert (0, "cpu/cpu: host memory grew by one table for all ranks (page cache shared)") in names


def test_dry_run_says_why_it_skipped(dry_run, cgroup):
    _, result = dry_run
    skipped = {(c["name"], c["detail"]) for c in result["checks"] if c["status"] == "SKIP"}
    expected = {
        ("registered/registered: whole run", SKIPPED_BY_GPU),
        ("registered/cpu: whole run", SKIPPED_BY_GPU),
        ("registered/registered + row cache: whole run", SKIPPED_BY_GPU),
        ("registered/cpu + row cache: whole run", SKIPPED_BY_GPU),
        ("engram registered: whole run", SKIPPED_BY_GPU),
        (
            "cpu/cpu + row cache: host memory grew by one table for all ranks (page cache shared)",
            "the row cache pass: no prewarm, misses read into the row cache",
        ),
    }
    for label in ("cpu/cpu", "cpu/cpu + row cache"):
        expected |= {
            (f"{label}: CUDA graph of lookup + all_reduce, replays with new ids == file rows", NO_GRAPHS),
            (
                f"{label}: CUDA graph of a step, its lookup issued early, replays with new ids == file rows",
                NO_GRAPHS,
            ),
        }
    for n in IDS:
        name = f"engram cpu: CUDA graph of lookup + all_gather, {n // 8} tokens, new hashes == file rows"
        expected.add((name, NO_GRAPHS))
    if not cgroup[0]:
        expected.add(
            (
                "memory limit: this rank in a memory cgroup of its own of 1.00 GiB",
                f"the run goes on without the limit: not enforced: {cgroup[1]}",
            )
        )
    assert skipped == expected
    assert result["early_lookups"]["streams"] is False
    assert "no CUDA device: the same step with no stream" in result["early_lookups"]["how"]


def test_dry_run_reports_row_cache_memory_limit_and_engram_split(dry_run, cgroup):
    proc, result = dry_run
    assert list(result["distributions"]) == list(DISTRIBUTIONS)
    assert [d["kind"] for d in result["distributions"].values()] == ["uniform", "zipf", "trace"]
    cache = result["row_cache"]
    for rank in (0, 1):
        assert "hits" not in cache["cpu/cpu"][rank]  # the prewarmed pass keeps no row cache
        mine = cache["cpu/cpu + row cache"][rank]
        assert mine["asked"] == 8 << 20 and 0 < mine["bytes"] <= 8 << 20
        assert mine["hits"] > 0 and mine["misses"] > 0 and mine["file_reads"] > 0
        assert (
            f"| cpu/cpu + row cache | {rank} | cpu | 8.0 MiB | {mine['hits']} | {mine['misses']} |"
            in proc.stdout
        )
    limits = result["memory_limit"]
    assert [limit["enforced"] for limit in limits] == [cgroup[0]] * 2
    if cgroup[0]:
        assert all(limit["limit"] == LIMIT and 0 < limit["peak_bytes"] <= LIMIT for limit in limits)
        assert len({limit["group"] for limit in limits}) == 2  # a group of its own each
    assert proc.stdout.count("memory limit of rank") == 2
    engram = result["engram"]
    assert [e["heads"] for e in engram] == [[0, 4], [4, 8]]
    sizes = engram[0]["head_rows"]
    assert len(sizes) == 8 and engram[0]["rows"] == [0, sum(sizes[:4])]
    assert engram[1]["rows"] == [sum(sizes[:4]), sum(sizes)] and sum(sizes) <= engram[0]["num_rows"]
    mem = result["memory"]["engram cpu"]
    assert [r["pinned_bytes"] for r in mem["ranks"]] == [0, 0]
    assert [r["owned_bytes"] for r in mem["ranks"]] == [
        (hi - lo) * 264 for lo, hi in (e["rows"] for e in engram)
    ]


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


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--distributions", "uniform,zipf:0.5"], "the Zipf exponent 0.5 is out of range"),
        (["--distributions", "normal"], "'normal' is not an id distribution"),
        (["--engram-size", "64KiB"], "too small for 8 heads (--engram-size)"),
        (["--row-cache", "lots"], "--row-cache: invalid parse_size value"),
    ],
)
def test_bad_options_are_refused_naming_the_option(argv, says, capsys):
    tp = load_tool("tp_check")
    with pytest.raises(SystemExit) as exc:
        tp.parse_args(["--backend", "gloo", "--device", "cpu", "--size", "32MiB", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_engram_split_is_vllms_layout():
    """The table's 8 heads laid out as vLLM's EngramLayout lays them (ple_um's geometry, which
    tests/checkpoint checks against it), split by heads as ple_um.vllm.engram splits them."""
    tp = load_tool("tp_check")
    for size in (4 << 20, 1 << 30):
        rows = tp.engram_rows(size)
        geometry = tp.engram_geometry(rows)
        sizes = geometry.head_sizes[0]
        assert len(sizes) == 8 and rows - 8 * 256 <= sum(sizes) <= rows
        assert geometry.head_rows(tp.ENGRAM_LAYER, 0, 4) == (0, sum(sizes[:4]))
        assert geometry.head_rows(tp.ENGRAM_LAYER, 4, 8) == (sum(sizes[:4]), sum(sizes))


def test_registered_is_skipped_where_its_pins_cannot_fit_the_memory_limit(tmp_path):
    """Pinned rows are charged to a rank's group and cannot be reclaimed: a mode set whose
    registered ranks would pin past their limit (less PIN_ROOM) is skipped, saying which rank."""
    tp = load_tool("tp_check")
    write_checkpoint(tmp_path, num_rows=6400, row_dim=160, dtype="fp8", shards=13, files=3, seed=4)
    rank = tp.Rank.__new__(tp.Rank)
    rank.files = tp.FileTable(str(tmp_path))
    rank.ranges = tp.vocab_ranges(6400, 2)
    spans = [rank.files.pinned_span(*rows)[0] for rows in rank.ranges]

    def refused(limits, modes):
        groups = [None if at is None else {"limit": at, "enforced": True} for at in limits]
        rank.args = types.SimpleNamespace(memory_groups=groups)
        return rank.pins_refused(modes)

    tight = [span + tp.PIN_ROOM - 1 for span in spans]
    roomy = [span + tp.PIN_ROOM for span in spans]
    assert refused(roomy, ["registered"] * 2) is None
    assert refused([None, None], ["registered"] * 2) is None  # no limit made
    assert refused([roomy[0], 1 << 20], ["registered", "cpu"]) is None  # a cpu rank pins nothing
    why = refused([roomy[0], tight[1]], ["registered"] * 2)
    assert why.startswith("rank 1 would pin ") and "under its memory limit of" in why
    assert refused([tight[0], roomy[1]], ["registered", "cpu"]).startswith("rank 0 would pin ")
    rank.args.memory_groups[0]["enforced"] = False  # where the limit could not be made
    assert rank.pins_refused(["registered", "cpu"]) is None


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
