"""The bench's run and its table: the defaults each kind of run takes for the options not given,
options that do not go together refused by the Config itself; the synthetic table written once, a
partial one never left or used."""

from __future__ import annotations

import os

import pytest

from ple_um.bench import config


def test_options_not_given_take_the_default_of_their_run():
    side = config.Config()
    assert side.kind == "side-by-side"
    assert (side.row_bytes, side.shards, side.rows, side.repeats) == (160, 128, config.DEFAULT_ROWS, 20)
    assert (side.step_ms, side.warmup_s, side.memory_limits) == (config.STEP_MS, config.WARMUP_S, ())
    assert (side.rounds, side.processes) == (config.ROUNDS, 0)
    limited = config.Config(memory_limits=(1 << 30,), warmup_s=0.0)
    assert (limited.rows, limited.warmup_s, limited.kind) == (config.COLD_ROWS, 0.0, "memory-limit")
    serving = config.Config(serving=True, step_ms=(3.0,))
    assert (serving.repeats, serving.step_ms, serving.kind) == (config.SERVING_STEPS, (3.0,), "serving")
    assert serving.serving_lookups == {"decode": 64 * 16, "prefill": config.PREFILL_TOKENS * 16}
    decode_only = config.Config(serving=True, prefill_tokens=0)
    assert decode_only.serving_lookups == {"decode": 64 * 16}
    engram = config.Config(model=config.ENGRAM_MODEL, rows=(16,), repeats=2)
    assert (engram.row_bytes, engram.shards, engram.rows, engram.repeats) == (264, 1, (16,), 2)
    assert config.Config(directory="/d", layer=3).layer == 3  # DIR's table: its own checks


@pytest.mark.parametrize(
    "given,message",
    [
        ({"warmup_s": 1.0}, "--warmup times the steady state of --memory-limit or --serving: give one"),
        ({"step_ms": (5.0,)}, "--step-ms sets the GPU work of --serving's steps: give --serving too"),
        ({"prefill_tokens": 0}, "--prefill-tokens sets the prefill chunk of --serving's steps"),
        ({"serving": True, "rows": (16,)}, "--rows is not a --serving option"),
        # The side-by-side run's own options, which the other runs would drop without a word.
        ({"memory_limits": (1 << 30,), "processes": 2}, "--processes is not a --memory-limit option"),
        ({"memory_limits": (1 << 30,), "rounds": 2}, "--rounds is not a --memory-limit option"),
        ({"serving": True, "rounds": 2}, "--rounds is not a --serving option"),
        ({"model": config.ENGRAM_MODEL, "shards": 1}, "--shards is a PLE table's option"),
        ({"layer": 3}, "--layer needs DIR: the synthetic table has one layer"),
        ({"size": 100}, "--size 100 B holds no row of 160 B (--row-bytes): give at least that"),
        ({"directory": "/d", "size": 100}, "--size shapes the synthetic table: DIR's table is benched as"),
        ({"directory": "/d", "row_bytes": 8}, "--row-bytes shapes the synthetic table"),
        ({"directory": "/d", "shards": 4}, "--shards shapes the synthetic table"),
    ],
)
def test_options_that_do_not_go_together_are_refused_by_the_config(given, message):
    with pytest.raises(config.BenchUsageError) as info:
        config.Config(**given)
    assert message in str(info.value)


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


@pytest.mark.parametrize("damage", ["a file removed", "a file cut short"])
def test_a_cached_table_damaged_since_it_was_written_is_written_again(tmp_path, monkeypatch, damage):
    """The synthetic table is the bench's own: one whose files were removed or cut short after it
    was written (a cleaner of the cache folder, a full disk) is written again, not an error on every
    run until someone finds the folder and removes it."""
    monkeypatch.setenv("PLE_UM_CACHE_DIR", str(tmp_path))
    cfg = config.Config(size=1 << 20, shards=8)
    first = config.bench_layout(cfg)
    sizes = [os.path.getsize(f) for f in first.files]
    shard = first.files[0]
    if damage == "a file removed":
        os.unlink(shard)
    else:
        os.truncate(shard, os.path.getsize(shard) // 2)
    again = config.bench_layout(cfg)
    assert again.directory == first.directory == config.table_path(cfg)
    assert (again.num_rows, again.row_bytes, again.files) == (first.num_rows, first.row_bytes, first.files)
    assert [os.path.getsize(f) for f in again.files] == sizes


@pytest.mark.parametrize(
    "given,message",
    [
        ({"rows": (16, 1024, 16)}, "--rows names 16 twice"),
        ({"memory_limits": (1 << 30, 2 << 30, 1 << 30)}, "--memory-limit names 1.00 GiB twice"),
        ({"serving": True, "step_ms": (5.0, 20.0, 5.0)}, "--step-ms names 5 twice"),
    ],
)
def test_a_figure_named_twice_is_refused(given, message):
    """Each batch size, limit and step time is one figure, keyed by its value in the results: one
    named twice would be timed twice (a child each under a limit) and the second run's figures would
    replace the first's in the JSON and the report without a word."""
    with pytest.raises(config.BenchUsageError) as info:
        config.Config(**given)
    assert message in str(info.value)


def test_figures_that_differ_by_a_byte_are_not_named_twice():
    limits = (1 << 30, (1 << 30) + 1)  # both print as 1.00 GiB, and are two limits
    assert config.Config(memory_limits=limits).memory_limits == limits


def test_two_runs_that_write_the_table_at_once_both_get_it_whole(tmp_path):
    """Two benches started together on a cache without the table (two GPUs of one machine): each
    removed the other's partial folder, and both failed on its vanished files. The writer holds a
    lock on the cache folder; the other waits, finds the table written and uses it."""
    import subprocess
    import sys

    size = 64 << 20
    # Each process imports first, then starts on its line of stdin: the two writes overlap.
    script = (
        "import sys, time; from ple_um.bench import config; "
        f"cfg = config.Config(size={size}, shards=8); print('ready', flush=True); "
        "time.sleep(float(sys.stdin.readline())); print(config.bench_layout(cfg).num_rows)"
    )
    env = {**os.environ, "PLE_UM_CACHE_DIR": str(tmp_path)}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    run = [sys.executable, "-c", script]
    procs = [
        subprocess.Popen(
            run, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdout.readline() == "ready\n"
    for p, delay in zip(procs, ("0\n", "0.3\n"), strict=True):
        p.stdin.write(delay)
        p.stdin.flush()
    outs = [p.communicate(timeout=300) for p in procs]
    cfg = config.Config(size=size, shards=8)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.split() == [str(cfg.num_rows)], err
    assert not os.path.exists(config.table_path(cfg) + ".partial")
