"""Property-based fuzzing of the checkpoint reader: headers, files and index files.

Whatever the bytes, reading a checkpoint ends in a ShardLayout or a CheckpointError — never another
exception, never a hang — and read_layout and validate agree (read_layout raises exactly the first
problem validate lists). Real files in a fresh temporary folder per example.
"""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import sys
import tempfile

import pytest
from helpers.reference import encode_safetensors, tensor_bytes, write_raw, write_safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ple_um.checkpoint import find_layers, read_layout, validate
from ple_um.errors import CheckpointError

FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
INDEX = "model.safetensors.index.json"
PLE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding."
SHARDS = [f"{PLE}shard_{i}.weight" for i in range(4)]
SCALE = f"{PLE}weight_scale"


def sound_tensors(rows=(3, 3, 3, 0), dim=4) -> dict[str, tuple[str, list[int], bytes]]:
    tensors = {
        s: ("F8_E4M3", [r, dim], tensor_bytes("F8_E4M3", [r, dim], seed=i))
        for i, (s, r) in enumerate(zip(SHARDS, rows, strict=True))
    }
    tensors[SCALE] = ("F32", [], struct.pack("<f", 0.0390625))
    tensors["model.language_model.embed_tokens.weight"] = ("BF16", [2, dim], tensor_bytes("BF16", [2, dim]))
    return tensors


# safetensors' JSON parser (serde_json) refuses arrays and objects nested deeper than this (the
# header object is level 1).
MAX_JSON_DEPTH = 127
BASE = encode_safetensors(sound_tensors(), metadata={"format": "pt"})
BASE_HEADER_END = 8 + struct.unpack("<Q", BASE[:8])[0]


@pytest.fixture(autouse=True)
def no_hang():
    """A hang fails the test instead of stalling the run."""

    def fail(signum, frame):
        raise TimeoutError("the checkpoint reader hung")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def check(directory: str, layer: int | None = None):
    """The layout, or None after a CheckpointError; asserts read_layout and validate agree."""
    try:
        layout = read_layout(directory, layer)
    except CheckpointError as e:
        problems = validate(directory, layer)
        assert problems and problems[0] == str(e)
        try:
            find_layers(directory)
        except CheckpointError:
            pass
        return None
    assert validate(directory, layer) == []
    assert sum(s.rows for s in layout.shards) == layout.num_rows > 0
    for s in layout.shards:
        assert s.offset + s.rows * layout.row_bytes <= os.path.getsize(s.path)
    if layout.scale is not None:
        assert math.isfinite(layout.scale) and layout.scale != 0
    assert layout.layer in find_layers(directory)
    return layout


def with_file(blob: bytes, name: str = "model.safetensors"):
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(blob)
        return check(directory)


def test_base_is_sound():
    layout = with_file(BASE)
    assert layout is not None and layout.num_rows == 9


# ------------------------------------------------------------------ raw bytes


@FUZZ
@given(
    st.one_of(
        st.integers(0, (1 << 64) - 1),
        st.integers(0, 2 * len(BASE)),
        st.sampled_from([0, 1, 7, 8, BASE_HEADER_END - 9, BASE_HEADER_END - 7, 100_000_000, 100_000_001]),
    )
)
def test_random_header_length(length):
    layout = with_file(struct.pack("<Q", length) + BASE[8:])
    if length != BASE_HEADER_END - 8:
        # Other lengths cut the JSON short or make it swallow data bytes; some spaces may be fine.
        assert layout is None or BASE[8 + length : BASE_HEADER_END].strip() == b""


@FUZZ
@given(st.integers(0, len(BASE)))
def test_truncated_file(size):
    layout = with_file(BASE[:size])
    assert (layout is not None) == (size == len(BASE))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, BASE_HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_byte_flips_in_header(flips):
    blob = bytearray(BASE)
    for at, value in flips:
        blob[at] = value
    with_file(bytes(blob))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(BASE) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_byte_flips_anywhere(flips):
    blob = bytearray(BASE)
    for at, value in flips:
        blob[at] = value
    with_file(bytes(blob))


@FUZZ
@given(st.binary(max_size=300), st.binary(max_size=64))
def test_random_header_bytes(header, data):
    with tempfile.TemporaryDirectory() as directory:
        write_raw(os.path.join(directory, "x.safetensors"), header, data)
        assert check(directory) is None


@FUZZ
@given(st.binary(min_size=1, max_size=40), st.integers(0, 200))
def test_non_utf8_in_header(junk, at):
    text = json.dumps({SHARDS[0]: {"dtype": "F8_E4M3", "shape": [1, 4], "data_offsets": [0, 4]}}).encode()
    at = min(at, len(text))
    header = text[:at] + b"\xff" + junk + text[at:]
    with tempfile.TemporaryDirectory() as directory:
        write_raw(os.path.join(directory, "x.safetensors"), header, b"\0" * 4)
        assert check(directory) is None


# ------------------------------------------------------------------ JSON of every shape

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)


@FUZZ
@given(JSON, st.binary(max_size=64))
def test_random_json_header(header, data):
    with tempfile.TemporaryDirectory() as directory:
        write_raw(os.path.join(directory, "x.safetensors"), json.dumps(header), data)
        check(directory)


NAMES = st.sampled_from(
    [
        *SHARDS,
        SCALE,
        f"{PLE}shard_01.weight",
        "other.weight",
        "layers.2.ple.ple_embedding.ngram_embedding.shard_0.weight",
    ]
)
DTYPES = st.sampled_from(["F8_E4M3", "F8_E5M2", "BF16", "F16", "F32", "U8", "F4", "I64", "XX"]) | st.text(
    max_size=5
)
SMALL = st.integers(-2, 12)
SHAPE = st.lists(SMALL, max_size=3) | st.lists(st.integers(0, 4), min_size=2, max_size=2) | JSON
OFFSETS = st.tuples(SMALL, st.integers(-2, 120)).map(list) | st.lists(st.integers(0, 120), max_size=3) | JSON
ENTRY = (
    st.fixed_dictionaries(
        {},
        optional={"dtype": DTYPES | JSON, "shape": SHAPE, "data_offsets": OFFSETS},
    )
    | JSON
)


@settings(max_examples=700, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(NAMES, ENTRY, max_size=6), st.integers(0, 120), st.binary(max_size=16))
def test_structured_entries(header, data_size, seed_bytes):
    """Headers whose entries are close to sound: wrong shapes, offsets past the end, overlaps."""
    data = (seed_bytes * (data_size // max(len(seed_bytes), 1) + 1))[:data_size].ljust(data_size, b"\x01")
    with tempfile.TemporaryDirectory() as directory:
        write_raw(os.path.join(directory, "x.safetensors"), header, data)
        check(directory)


@FUZZ
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=6),
    st.integers(1, 4),
    st.sampled_from(["F8_E4M3", "BF16"]),
    st.permutations(range(6)),
)
def test_row_layout_oracle(rows, dim, dtype, order):
    """A table is accepted exactly when its rows follow the ceil layout and it has rows at all."""
    names = [f"{PLE}shard_{i}.weight" for i in range(len(rows))]
    tensors = {
        n: (dtype, [r, dim], tensor_bytes(dtype, [r, dim], seed=i))
        for i, (n, r) in enumerate(zip(names, rows, strict=True))
    }
    tensors[SCALE] = ("F32", [1], struct.pack("<f", 2.5))
    layout_order = [names[i] for i in order if i < len(names)] + [SCALE]
    total, parts = sum(rows), len(rows)
    per = -(-total // parts)
    sound = total > 0 and all(r == min(max(total - i * per, 0), per) for i, r in enumerate(rows))
    with tempfile.TemporaryDirectory() as directory:
        write_safetensors(os.path.join(directory, "x.safetensors"), tensors, order=layout_order)
        layout = check(directory)
        assert (layout is not None) == sound
        if layout is not None:
            with open(os.path.join(directory, "x.safetensors"), "rb") as f:
                blob = f.read()
            for s in layout.shards:
                assert blob[s.offset : s.offset + s.rows * layout.row_bytes] == tensors[s.tensor][2]


@FUZZ
@given(st.binary(min_size=4, max_size=4), st.sampled_from([("F32", []), ("F32", [1])]))
def test_scale_bytes(raw, kind):
    tensors = sound_tensors()
    tensors[SCALE] = (kind[0], kind[1], raw)
    layout = with_file(encode_safetensors(tensors))
    (value,) = struct.unpack("<f", raw)
    assert (layout is not None) == (math.isfinite(value) and value != 0)


# ------------------------------------------------------------------ nesting and size


@settings(max_examples=25, deadline=None, database=None)
@given(
    st.integers(1, 200_000),
    st.sampled_from(["[", '{"a":', '{"t": {"dtype": "U8", "data_offsets": [0, 0], "shape": ']),
    st.booleans(),
)
def test_deep_nesting(depth, opener, closed):
    closer = {"[": "]", '{"a":': "}"}.get(opener, "]")
    if opener.startswith('{"t"'):
        text = opener + "[" * depth + "]" * depth + "}}" if closed else opener + "[" * depth
    else:
        text = opener * depth + ("1" if opener != "[" else "") + (closer * depth if closed else "")
    with tempfile.TemporaryDirectory() as directory:
        write_raw(os.path.join(directory, "x.safetensors"), text)
        assert check(directory) is None


def _at_stack_depth(frames: int, fn):
    return fn() if frames == 0 else _at_stack_depth(frames - 1, fn)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH - 1, 1982])
def test_how_deep_is_too_deep_does_not_depend_on_the_callers_stack(depth):
    """The same verdict, naming the same entry, from a shallow and a deep caller: the package judges
    the nesting, and the entry at fault is found without Python's recursion limit deciding it (that
    limit counts the caller's frames: a header 1 982 deep parsed by Python's json alone would be
    refused as too deep from one caller and as cut short from another)."""
    opener = '{"t": {"dtype": "U8", "data_offsets": [0, 0], "shape": '  # two levels, then the shape's
    with tempfile.TemporaryDirectory() as directory:
        write_raw(os.path.join(directory, "x.safetensors"), opener + "[" * depth)
        verdicts = []
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(2500)  # as under hypothesis: a 1 982-deep parse fits from a shallow caller
        try:
            for frames in (0, 300, 700):
                try:
                    _at_stack_depth(frames, lambda: read_layout(directory))
                except CheckpointError as e:
                    verdicts.append((str(e), e.tensor))
        finally:
            sys.setrecursionlimit(limit)
        assert len(verdicts) == 3 and len(set(verdicts)) == 1, verdicts
        message, tensor = verdicts[0]
        assert ("recursion limit exceeded" in message) == (depth + 2 > MAX_JSON_DEPTH), message
        assert tensor == "t"


@settings(max_examples=4, deadline=None, database=None)
@given(st.integers(1_000, 60_000), st.booleans())
def test_huge_headers(entries, sound):
    """Many entries: only headers are read, and a large sound header is accepted."""
    tensors = sound_tensors()
    header = {}
    offset = 0
    for i in range(entries):
        header[f"filler.{i}.weight"] = {"dtype": "U8", "shape": [1], "data_offsets": [offset, offset + 1]}
        offset += 1
    blob = bytearray(encode_safetensors(tensors))
    length = struct.unpack("<Q", blob[:8])[0]
    base = json.loads(blob[8 : 8 + length])
    data = bytes(blob[8 + length :])
    for name, meta in base.items():
        meta["data_offsets"] = [o + offset for o in meta["data_offsets"]]
        header[name] = meta
    if not sound:
        header["filler.0.weight"]["data_offsets"] = [0, 2]  # overlaps filler.1
    with tempfile.TemporaryDirectory() as directory:
        write_raw(os.path.join(directory, "x.safetensors"), header, b"\0" * offset + data)
        assert (check(directory) is not None) == sound


@settings(max_examples=3, deadline=None, database=None)
@given(st.integers(1 << 20, 4 << 20))
def test_huge_string_value(size):
    header = {"__metadata__": {"blob": "x" * size}, **json.loads(BASE[8:BASE_HEADER_END])}
    with tempfile.TemporaryDirectory() as directory:
        write_raw(os.path.join(directory, "x.safetensors"), header, BASE[BASE_HEADER_END:])
        assert check(directory) is not None


# ------------------------------------------------------------------ index files

TARGETS = (
    st.sampled_from(
        [
            "model.safetensors",
            "./model.safetensors",
            "sub/../model.safetensors",
            "../model.safetensors",
            "/etc/passwd",
            "",
            ".",
            "..",
            "a\0b",
            "missing.safetensors",
            "dangling.safetensors",
            "sub",
            "x" * 300,
        ]
    )
    | st.text(max_size=12)
    | JSON
)


@FUZZ
@given(
    st.dictionaries(st.sampled_from([*SHARDS, SCALE, "lm_head.weight"]), TARGETS, max_size=6), st.booleans()
)
def test_index_entries(weight_map, complete):
    """Index entries naming files outside the folder, missing files, symlinks to nothing, non-strings."""
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "model.safetensors"), "wb") as f:
            f.write(BASE)
        os.mkdir(os.path.join(directory, "sub"))
        os.symlink(os.path.join(directory, "nothing"), os.path.join(directory, "dangling.safetensors"))
        if complete:
            weight_map = {**{n: "model.safetensors" for n in [*SHARDS, SCALE]}, **weight_map}
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        layout = check(directory)
        valid = ("model.safetensors", "./model.safetensors", "sub/../model.safetensors")
        ple_targets = [weight_map[n] for n in [*SHARDS, SCALE] if n in weight_map]
        # The PLE entries lead to the one file, which holds every tensor; the others only need to
        # stay inside the folder (their files are never opened).
        sane = bool(ple_targets) and all(t in valid for t in ple_targets)
        others_inside = all(
            isinstance(v, str)
            and v
            and "\0" not in v
            and not os.path.isabs(v)
            and os.path.normpath(v) != ".."
            and not os.path.normpath(v).startswith("../")
            for v in weight_map.values()
        )
        assert (layout is not None) == (sane and others_inside)


@FUZZ
@given(JSON | st.dictionaries(st.just("weight_map"), JSON))
def test_random_index_json(index):
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "model.safetensors"), "wb") as f:
            f.write(BASE)
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump(index, f)
        check(directory)


@FUZZ
@given(st.binary(max_size=200))
def test_random_index_bytes(raw):
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "model.safetensors"), "wb") as f:
            f.write(BASE)
        with open(os.path.join(directory, INDEX), "wb") as f:
            f.write(raw)
        check(directory)
