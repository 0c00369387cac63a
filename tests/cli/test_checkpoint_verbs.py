"""`ple-um inspect`, `residency` and `prewarm` on real checkpoints written to disk (sound and
deliberately broken): the verdict with one problem per broken file, naming it; page-cache residency
that moves as it should under prewarm and POSIX_FADV_DONTNEED; prewarm's refusal and the advice in
it, taken as given."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers.cli import fs_type, run, run_cli, run_json, two_layer_checkpoint
from helpers.reference import drop_page_cache

from ple_um import cli, operating, units
from ple_um.access import memory
from ple_um.synthetic import write_checkpoint

MiB = 1 << 20


# -- inspect -------------------------------------------------------------------------------------
def test_inspect_sound_checkpoint(capsys, table_dir):
    path, layout = table_dir
    code, data = run_json(capsys, "inspect", path)
    assert code == 0
    assert data["valid"] is True and data["problems"] == []
    assert data["layers"] == [1]
    (t,) = data["tables"]
    assert t["layer"] == 1
    assert t["dtype"] == "F8_E4M3"
    assert (t["rows"], t["row_dim"], t["row_bytes"]) == (layout.num_rows, 160, 160)
    assert t["bytes"] == layout.nbytes
    assert t["parts"] == 8 and len(t["shards"]) == 8
    assert t["rows_per_shard"] == layout.rows_per_shard
    assert t["scale"] == pytest.approx(layout.scale)
    assert sum(s["rows"] for s in t["shards"]) == layout.num_rows
    assert [s["offset"] for s in t["shards"]] == [s.offset for s in layout.shards]
    assert sorted(f["file"] for f in t["files"]) == sorted(os.path.basename(f) for f in layout.files)
    assert sum(f["bytes"] for f in t["files"]) == layout.nbytes

    code, out, _ = run(capsys, "inspect", path, "--shards")
    assert code == 0
    assert "verdict: sound" in out
    assert f"layer 1: {layout.num_rows} rows x 160 F8_E4M3" in out
    assert "| 7 |" in out  # the shard listing


def test_inspect_bf16_has_no_scale(capsys, tmp_path):
    write_checkpoint(tmp_path / "bf", num_rows=100, row_dim=8, dtype="bf16", shards=3)
    code, data = run_json(capsys, "inspect", str(tmp_path / "bf"))
    assert code == 0
    assert data["tables"][0]["scale"] is None
    assert data["tables"][0]["row_bytes"] == 16


def test_inspect_several_layers_and_layer_option(capsys, tmp_path):
    """Two layers in one checkpoint (files and index merged): inspect lists both, --layer picks one."""
    a = two_layer_checkpoint(tmp_path)
    code, data = run_json(capsys, "inspect", a)
    assert code == 0, data["problems"]
    assert data["layers"] == [1, 3]
    assert [(t["layer"], t["rows"]) for t in data["tables"]] == [(1, 50), (3, 30)]

    code, data = run_json(capsys, "inspect", a, "--layer", "3")
    assert code == 0
    assert [t["layer"] for t in data["tables"]] == [3]

    code, data = run_json(capsys, "inspect", a, "--layer", "2")  # a bad argument, as in every verb
    assert code == 2
    assert data == {"error": f"--layer 2: no PLE shards of layer 2 in {a}; layers with shards: 1, 3"}
    code, data = run_json(capsys, "residency", a, "--layer", "3")
    assert code == 0 and data["layer"] == 3


def test_inspect_truncated_and_corrupt_files_one_problem_each(capsys, table_dir):
    path, layout = table_dir
    truncated, corrupt = layout.files[1], layout.files[2]
    os.truncate(truncated, os.path.getsize(truncated) - 1000)
    with open(corrupt, "r+b") as f:
        f.seek(12)  # inside the JSON header
        f.write(b"\xff\xfe")

    code, data = run_json(capsys, "inspect", path)
    assert code == 1
    assert data["valid"] is False
    assert data["tables"] == []
    problems = data["problems"]
    # One problem per broken file: not their shards again as missing (the index names their files).
    assert len(problems) == 2, problems
    assert any(truncated in p and "truncated" in p for p in problems)
    assert any(corrupt in p and "header" in p for p in problems)
    assert not any("missing" in p for p in problems)

    code, out, _ = run(capsys, "inspect", path)
    assert code == 1
    assert f"verdict: INVALID, {len(problems)} problems:" in out
    for p in problems:
        assert f"  - {p}" in out


def test_inspect_missing_fp8_scale(capsys, tmp_path):
    """An FP8 table whose scale tensor was renamed (same length, in the header) and dropped from
    the index: the verdict names the missing scale."""
    path = tmp_path / "noscale"
    layout = write_checkpoint(path, num_rows=40, row_dim=16, dtype="fp8", shards=4, files=4)
    with open(layout.files[-1], "r+b") as f:
        header = f.read(8 + int.from_bytes(f.read(8), "little"))
        f.seek(header.index(b"weight_scale"))
        f.write(b"weight_scalX")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("weight_scale")}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    code, data = run_json(capsys, "inspect", str(path))
    assert code == 1
    assert any("without its global scale" in p for p in data["problems"])


# -- residency and prewarm ---------------------------------------------------------------------
def test_residency_json_shape(capsys, table_dir):
    path, layout = table_dir
    code, data = run_json(capsys, "residency", path)
    assert code == 0
    assert data["layer"] == 1
    assert data["page_size"] == os.sysconf("SC_PAGE_SIZE")
    assert [s["index"] for s in data["shards"]] == list(range(8))
    assert sum(s["bytes"] for s in data["shards"]) == layout.nbytes
    assert data["total"]["bytes"] == layout.nbytes
    for s in data["shards"]:
        assert 0 <= s["resident_bytes"] <= s["bytes"]
        assert s["fraction"] == pytest.approx(s["resident_bytes"] / s["bytes"])
    assert sorted(f["file"] for f in data["files"]) == sorted(os.path.basename(f) for f in layout.files)

    code, out, _ = run(capsys, "residency", path)
    assert code == 0
    assert out.splitlines()[0] == "| shard | file | bytes | resident | % |"
    assert out.splitlines()[-2].startswith("total: ")
    assert out.splitlines()[-1].startswith("row cache of a table opened now: ")


def test_residency_says_which_row_cache_a_table_opened_now_takes(capsys, table_dir, monkeypatch):
    """The row cache beside the page cache: none for a table that fits in memory (auto), in the page
    cache or not, the size asked for (PLE_UM_ROW_CACHE), the size auto takes for a table that does
    not fit; the knobs it reads are checked before any work."""
    path, layout = table_dir
    code, data = run_json(capsys, "prewarm", path)
    assert code == 0
    code, data = run_json(capsys, "residency", path)
    assert code == 0 and data["total"]["fraction"] > 0.99
    assert data["row_cache"]["bytes"] == 0 and "no row cache" in data["row_cache"]["why"]

    monkeypatch.setenv("PLE_UM_ROW_CACHE", "1MiB")
    code, data = run_json(capsys, "residency", path)
    cache = data["row_cache"]
    assert (cache["bytes"], cache["policy"]) == (1 << 20, "tinylfu")
    assert cache["reads"] in ("uring", "threads") and cache["direct"] is True
    code, out, _ = run(capsys, "residency", path)
    assert out.splitlines()[-1] == f"row cache of a table opened now: {cache['why']}"
    assert "a row cache of 1.00 MiB" in cache["why"]

    with monkeypatch.context() as patch:
        patch.setattr(memory, "available", lambda: 1 << 19)  # a size past the memory left
        code, data = run_json(capsys, "residency", path)
    assert code == 0 and data["row_cache"]["bytes"] == 0
    assert data["row_cache"]["why"].startswith("an open now would be refused: environment variable")

    monkeypatch.setenv("PLE_UM_ROW_CACHE", "lots")
    code, out, err = run(capsys, "residency", path)
    assert code == 2 and out == "" and "PLE_UM_ROW_CACHE" in err and "'lots'" in err

    monkeypatch.setenv("PLE_UM_ROW_CACHE", "auto")
    if fs_type(path) == "tmpfs":
        pytest.skip("tmpfs files are their page cache: DONTNEED cannot drop them")
    drop_page_cache(layout)
    code, data = run_json(capsys, "residency", path)
    assert data["total"]["fraction"] < 0.05
    assert data["row_cache"]["bytes"] == 0 and "fit in memory" in data["row_cache"]["why"]
    monkeypatch.setattr(memory, "mem_available", lambda: 2 * MiB)  # the 4 MiB table does not fit
    monkeypatch.setattr(memory, "cgroup_headroom", lambda *a, **k: None)
    code, data = run_json(capsys, "residency", path)
    assert data["row_cache"]["bytes"] > 0 and "do not fit" in data["row_cache"]["why"]


def test_residency_follows_prewarm_and_dontneed(capsys, table_dir):
    path, layout = table_dir
    if fs_type(path) == "tmpfs":
        pytest.skip("tmpfs files are their page cache: DONTNEED cannot drop them")

    code, data = run_json(capsys, "prewarm", path)
    assert code == 0
    assert data["read_bytes"] >= layout.nbytes
    assert data["after"]["fraction"] > 0.99
    code, data = run_json(capsys, "residency", path)
    assert data["total"]["fraction"] > 0.99
    assert all(s["fraction"] > 0.99 for s in data["shards"])

    drop_page_cache(layout)
    code, data = run_json(capsys, "residency", path)
    assert code == 0
    assert data["total"]["fraction"] < 0.05
    assert all(s["fraction"] < 0.1 for s in data["shards"])

    # Half of each file: at least the first shard of each file (2 shards per file) comes in; the
    # kernel's readahead may bring in more (here up to the device's read_ahead_kb).
    code, data = run_json(capsys, "prewarm", path, "--fraction", "0.5")
    assert code == 0
    assert data["requested_bytes"] <= layout.nbytes // 2 + 4 * os.sysconf("SC_PAGE_SIZE")
    assert data["after"]["fraction"] >= 0.49
    code, data = run_json(capsys, "residency", path)
    fractions = [s["fraction"] for s in data["shards"]]
    assert all(f > 0.99 for f in fractions[0::2]), fractions

    drop_page_cache(layout)
    code, out, err = run(capsys, "prewarm", path)  # text, with its progress bar
    assert code == 0
    assert "prewarmed 4.00 MiB" in out
    assert "-> 100.0%" in out
    assert "prewarm" in err and "100%" in err  # tqdm


def test_prewarm_refuses_more_than_allowed(capsys, table_dir):
    path, layout = table_dir
    drop_page_cache(layout)
    before = operating.residency(path)["total"]["resident_bytes"]

    code, out, err = run(capsys, "prewarm", path, "--max-bytes", "1MiB")
    assert code == cli.EXIT_REFUSED
    assert out == ""
    assert "ple-um prewarm: error:" in err
    assert "more than the --max-bytes limit (1.00 MiB)" in err
    assert "--fraction" in err and "--force" in err
    assert operating.residency(path)["total"]["resident_bytes"] <= before + 64 * 1024  # nothing read

    code, data = run_json(capsys, "prewarm", path, "--max-bytes", "1MiB")
    assert code == cli.EXIT_REFUSED
    assert data["refused"] is True and "--force" in data["error"]

    code, data = run_json(capsys, "prewarm", path, "--max-bytes", "1MiB", "--force")
    assert code == 0
    assert data["forced"] is True
    if fs_type(path) != "tmpfs":
        assert data["after"]["fraction"] > 0.99


def test_prewarm_refusal_against_mem_available(table_dir):
    """Without --max-bytes the limit is MemAvailable; ``available`` stands in for a small one."""
    path, layout = table_dir
    small = lambda: layout.nbytes // 2
    with pytest.raises(operating.PrewarmRefused, match=r"more than MemAvailable \(2.00 MiB\)"):
        operating.prewarm(path, available=small)
    result = operating.prewarm(path, available=small, fraction=0.25)
    assert result["requested_bytes"] <= layout.nbytes // 2
    assert result["mem_available"] == layout.nbytes // 2 and not result["forced"]
    assert operating.prewarm(path, available=small, force=True)["forced"] is True
    assert operating.prewarm(path)["mem_available"] > 0  # the real MemAvailable: this table fits


@pytest.mark.parametrize("fraction", ["0", "1.5", "-1", "nan", "half"])
def test_prewarm_bad_fraction(capsys, table_dir, fraction):
    """A bad --fraction is a bad argument (exit 2), not an invalid checkpoint (exit 1)."""
    path, layout = table_dir
    code, out, err = run(capsys, "prewarm", path, "--fraction", fraction)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"ple-um prewarm: error: argument --fraction: must be in (0, 1], got {fraction!r} "
        "(see ple-um prewarm --help)"
    ]
    code, data = run_json(capsys, "prewarm", path, "--fraction", fraction)
    assert code == 2
    assert data == {"error": f"argument --fraction: must be in (0, 1], got {fraction!r}"}


def test_residency_and_prewarm_of_a_broken_checkpoint(capsys, table_dir):
    path, layout = table_dir
    os.truncate(layout.files[0], 100)
    for verb in ("residency", "prewarm"):
        code, out, err = run(capsys, verb, path)
        assert code == 1
        assert f"ple-um {verb}: error:" in err and layout.files[0] in err
        code, data = run_json(capsys, verb, path)
        assert code == 1 and layout.files[0] in data["error"]


def _scales_in_their_own_file(layout, directory):
    """A copy of an NVFP4 checkpoint whose shards' block scales sit in one file of their own."""
    from safetensors.torch import load_file, save_file

    from ple_um.checkpoint import read_layout

    os.makedirs(directory)
    layout_dir = layout.directory
    with open(os.path.join(layout_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    weight_map, scales = {}, {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(layout_dir, name))
        keep = {k: v for k, v in tensors.items() if not (".shard_" in k and k.endswith(".weight_scale"))}
        scales.update({k: v for k, v in tensors.items() if k not in keep})
        save_file(keep, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keep, name))
    save_file(scales, os.path.join(directory, "model-scales.safetensors"), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(scales, "model-scales.safetensors"))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return read_layout(str(directory))


def test_nvfp4_block_scales_in_a_file_of_their_own(capsys, make_checkpoint, tmp_path):
    """inspect lists the scales' file (its text crashed on a file holding no shard's rows), and
    prewarm reads the block scales too (every lookup reads them)."""
    layout = _scales_in_their_own_file(
        make_checkpoint(dtype="nvfp4", num_rows=20000, row_dim=64, shards=4), tmp_path / "split"
    )
    path = layout.directory
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "  model-scales.safetensors: block scales, 78.12 KiB" in out.splitlines()
    scale_files = layout.scale_layout().files
    drop_page_cache(layout)
    drop_page_cache(layout.scale_layout())
    code, data = run_json(capsys, "prewarm", path)
    assert code == 0 and data["requested_bytes"] >= layout.nbytes
    assert data["after"]["bytes"] == layout.nbytes
    if fs_type(path) != "tmpfs":
        assert data["before"]["fraction"] < 0.5 and data["after"]["fraction"] > 0.99
        code, residency = run_json(capsys, "residency", path)
        assert residency["block_scales"]["total"]["fraction"] > 0.99, scale_files


def test_prewarm_suggests_a_fraction_that_fits(table_dir):
    """The refusal's --fraction, asked for with the same limit, is taken (it was computed as if the
    whole table had been asked for)."""
    path, layout = table_dir
    limit = layout.nbytes // 4
    with pytest.raises(operating.PrewarmRefused) as info:
        operating.prewarm(path, fraction=0.5, limit=limit)
    suggested = float(re.search(r"--fraction (\S+) \(", str(info.value)).group(1))
    assert operating.prewarm(path, fraction=suggested, limit=limit)["requested_bytes"] <= limit


# -- one problem per broken file, naming it ---------------------------------------------------------
def _file(layout, k: int) -> str:
    """The k-th (1-based) of the table's five files."""
    return os.path.join(layout.directory, f"model-{k:05d}-of-00005.safetensors")


def test_a_truncated_file_is_one_problem_naming_it(capsys, five_files):
    """model-00002 truncated: one problem, in that file, naming its last shard; not its shards
    again as missing "in" another file; the layers are still read from the other headers."""
    path, layout = five_files
    os.truncate(_file(layout, 2), 5000)
    code, data = run_json(capsys, "inspect", path)
    assert code == 1 and data["layers"] == [1]
    (problem,) = data["problems"]
    assert "the file ends" in problem and "before the last tensor does" in problem
    assert f"(file {_file(layout, 2)}, tensor " in problem and problem.endswith("shard_3.weight)")
    code, out, _ = run(capsys, "inspect", path)
    assert "PLE layers with shards: 1\n" in out and "verdict: INVALID, 1 problem:" in out


@pytest.mark.parametrize("k", [2, 4, 5])
def test_a_deleted_file_is_one_problem_naming_it(capsys, five_files, k):
    """A file the index names is gone (the fifth holds the scale too): one problem naming it, not
    its shards as missing nor the scale as absent "in" another file."""
    path, layout = five_files
    os.remove(_file(layout, k))
    code, data = run_json(capsys, "inspect", path)
    assert code == 1 and data["layers"] == [1]
    (problem,) = data["problems"]
    assert f"index entry names 'model-{k:05d}-of-00005.safetensors', a missing file" in problem


def test_an_unreadable_header_is_one_problem(capsys, five_files):
    path, layout = five_files
    os.truncate(_file(layout, 3), 4)
    code, data = run_json(capsys, "inspect", path)
    assert code == 1 and data["layers"] == [1]
    assert data["problems"] == [
        f"file is 4 bytes, too short for a safetensors header (file {_file(layout, 3)})"
    ]


def test_an_nvfp4_table_with_a_deleted_file_is_one_problem(capsys, tmp_path):
    """The rows, block scales and global scale in the lost file are not each reported again."""
    layout = write_checkpoint(tmp_path / "nv", num_rows=1000, row_dim=64, dtype="nvfp4", shards=10, files=5)
    os.remove(os.path.join(layout.directory, "model-00005-of-00005.safetensors"))
    code, data = run_json(capsys, "inspect", layout.directory)
    assert code == 1
    (problem,) = data["problems"]
    assert "index entry names 'model-00005-of-00005.safetensors', a missing file" in problem


def test_a_shard_missing_with_no_broken_file_is_still_reported(capsys, five_files):
    """The suppression covers only what a reported file explains: a shard dropped from its file
    and from the index is missing, said so."""
    path, layout = five_files
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.loads(open(index_path).read())
    shard = next(name for name in index["weight_map"] if name.endswith("shard_4.weight"))
    del index["weight_map"][shard]
    with open(index_path, "w") as f:
        json.dump(index, f)
    with open(_file(layout, 3), "r+b") as f:  # shard 4's file: rename the tensor in its header
        header = f.read(8 + int.from_bytes(f.read(8), "little"))
        f.seek(header.index(b"shard_4.weight"))
        f.write(b"shard_4.weighX")
    code, data = run_json(capsys, "inspect", path)
    assert code == 1
    assert any("1 of shard indices 0..9 missing: 4" in p for p in data["problems"]), data["problems"]


# -- prewarm's advice and its limit ----------------------------------------------------------------
@pytest.mark.parametrize("limit", ["1KiB", "100KiB", "1MiB", "3MiB"])
def test_prewarm_advice_is_taken_as_given(capsys, table_dir, limit):
    """The --fraction a refusal suggests, asked for with the same --max-bytes, is taken: the
    command line the refusal names works (as typed, for the smallest limit)."""
    path, layout = table_dir
    code, out, err = run(capsys, "prewarm", path, "--max-bytes", limit)
    assert code == cli.EXIT_REFUSED and out == ""
    fraction = re.search(r"--fraction (\S+) \(", err).group(1)
    assert "raise --max-bytes, or pass --force" in err
    code, data = run_json(capsys, "prewarm", path, "--max-bytes", limit, "--fraction", fraction)
    assert code == 0, data
    assert 0 < data["requested_bytes"] <= units.parse_size(limit)
    if limit == "1KiB":
        done = run_cli("prewarm", path, "--max-bytes", limit, "--fraction", fraction, "--quiet")
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("limit", [None, 1])
def test_a_prewarm_refusal_no_fraction_fits_says_what_is_left(table_dir, limit):
    """Where no --fraction fits (here: not one byte), the refusal's advice is still a sentence:
    what is left to do, capitalized, with no dangling "or"."""
    path, _ = table_dir
    with pytest.raises(operating.PrewarmRefused) as info:
        operating.prewarm(path, limit=limit, available=lambda: 1)
    message = str(info.value)
    assert "--fraction" not in message
    left = "Raise --max-bytes, or pass --force" if limit else "Pass --force"
    assert message.endswith(f"to hold the rest. {left}"), message


def test_prewarm_max_bytes_0_is_refused(capsys, table_dir):
    path, _ = table_dir
    code, out, err = run(capsys, "prewarm", path, "--max-bytes", "0")
    assert code == 2 and out == ""
    assert err.strip() == (
        "ple-um prewarm: error: argument --max-bytes: must be at least 1 byte, got '0' "
        "(see ple-um prewarm --help)"
    )


def test_prewarm_prints_no_zero_rate(capsys, table_dir):
    path, _ = table_dir
    code, out, _ = run(capsys, "prewarm", path, "--quiet")
    assert code == 0
    assert "0.00 GB/s" not in out and re.search(r" s, [\d.]+ [KMGT]?i?B/s", out.splitlines()[0]), out


def test_files_of_one_name_in_two_folders_stay_apart(capsys, tmp_path):
    """An index may name files in folders of the checkpoint: two files both called
    model.safetensors are two files to inspect (each with its own shards and bytes) and to
    residency, named by their path in the checkpoint."""
    from helpers.hand_checkpoints import indexed, ple

    tensors = ple(rows=(3, 3, 3, 0))
    names = sorted(tensors)
    first = {name: tensors[name] for name in names[:2]}
    second = {name: tensors[name] for name in names[2:]}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    path = indexed(tmp_path, {"a/model.safetensors": first, "b/model.safetensors": second})
    code, data = run_json(capsys, "inspect", path)
    assert code == 0, data
    (table,) = data["tables"]
    files = {f["file"]: f for f in table["files"]}
    assert sorted(files) == ["a/model.safetensors", "b/model.safetensors"]
    assert sum(f["bytes"] for f in files.values()) == table["bytes"]
    by_file = {s["index"]: s["file"] for s in table["shards"]}
    for name in files:
        assert files[name]["shards"] == sorted(i for i, f in by_file.items() if f == name)
    assert set(by_file.values()) == set(files)
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "in 2 files" in out
    code, residency = run_json(capsys, "residency", path)
    assert code == 0
    assert sorted(f["file"] for f in residency["files"]) == sorted(files)
    mapped = {i: f for i, f in by_file.items() if i != 3}  # shard 3 holds no rows: nothing mapped
    assert {s["index"]: s["file"] for s in residency["shards"]} == mapped


def test_a_file_of_shards_apart_lists_them(capsys, tmp_path):
    """A file that holds shards 0 and 3, another 1 and 2 (an index may send any shard to any
    file): inspect's text names the shards each file holds, never a span over another's."""
    from helpers.hand_checkpoints import indexed, ple, shard

    tensors = ple(rows=(3, 3, 3, 3, 3, 0))
    outer = {shard(0), shard(3), shard(4), shard(5)}
    files = {
        "model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if n in outer},
        "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n not in outer},
    }
    code, out, _ = run(capsys, "inspect", indexed(tmp_path, files))
    assert code == 0, out
    assert "  model-00001-of-00002.safetensors: shards 0, 3-5, 36 B" in out.splitlines(), out
    assert "  model-00002-of-00002.safetensors: shards 1-2, 24 B" in out.splitlines(), out


def test_residency_text_says_the_block_scales_its_total_counts(capsys, make_checkpoint):
    """An NVFP4 table's total counts its block scales (every lookup reads them): the text says how
    much of them is resident, so that its lines add up to the total."""
    layout = make_checkpoint(dtype="nvfp4", num_rows=4000, row_dim=64, shards=4)
    code, data = run_json(capsys, "residency", layout.directory)
    assert code == 0
    scales = data["block_scales"]["total"]
    assert sum(s["bytes"] for s in data["shards"]) + scales["bytes"] == data["total"]["bytes"]
    code, out, _ = run(capsys, "residency", layout.directory)
    assert code == 0
    line = (
        f"block scales: {units.format_bytes(scales['resident_bytes'])} of "
        f"{units.format_bytes(scales['bytes'])} resident ({100 * scales['fraction']:.1f}%)"
    )
    assert line in out.splitlines(), out


@pytest.mark.parametrize("verb", ["residency", "prewarm", "probe"])
def test_a_checkpoint_of_engram_tables_names_what_it_holds(capsys, tmp_path, verb):
    """The verbs of one PLE table given a checkpoint of Engram tables alone: not a broken checkpoint
    (exit 1) but the wrong verb for it (exit 2), naming the Engram table and its layer."""
    from ple_um.synthetic_engram import write_engram_checkpoint

    write_engram_checkpoint(tmp_path / "engram", tables={3: 500})
    code, out, err = run(capsys, verb, str(tmp_path / "engram"))
    assert code == cli.EXIT_USAGE and not out, err
    assert "no PLE shards" in err
    assert f"it holds an Engram table (layer 3); `ple-um {verb}` reads PLE tables" in err
