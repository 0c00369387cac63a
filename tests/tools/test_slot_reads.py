"""tools/slot_reads.py: the row cache's hits served by the cpu mode and by the gather kernel reading
the cache's slots, on a real table on the CPU (the kernel under the Triton interpreter): the tool
checks every element of every call itself; here it runs to the end, every id found, no row missed."""

from __future__ import annotations

import json

from helpers.tools import load_tool

from ple_um.lookup.host.row_cache import slots_for


def test_slot_reads_agree_with_the_cpu_mode_and_the_files(make_checkpoint, tmp_path, capsys):
    script = load_tool("slot_reads")
    layout = make_checkpoint(num_rows=20_000, row_dim=160, dtype="fp8", shards=4, files=2, seed=5)
    out = tmp_path / "slots.json"
    argv = ["--dir", str(layout.directory), "--device", "cpu", "--cache", "2MiB", "--hot", "3000"]
    assert (
        script.main([*argv, "--calls", "2", "--warmup", "1", "--checks", "3", "--json-file", str(out)]) == 0
    )
    found = json.loads(out.read_text())
    assert found["device"] == "cpu" and found["hot_rows"] == 3000
    # A cache of 2 MiB has about 12 000 slots: nearly every hot row is kept (a set may overflow).
    assert 2900 <= found["held_rows"] <= 3000 and found["row_cache"]["slots"] == slots_for(2 << 20, 160)
    assert set(found["sizes"]) == {"1024", "16"}
    for n, sizes in found["sizes"].items():
        assert sizes["a_misses"] == 0 and sizes["checked_against_files"] == 3, n
        assert "a_graph" not in sizes  # no CUDA: no graph replay
        assert sizes["b_eager"]["samples"] == sizes["a_eager"]["samples"] == 2
        assert sizes["ratio_b_eager_to_a_eager"] > 0
    assert "| 1024 | (b) slot reads, eager |" in capsys.readouterr().out
