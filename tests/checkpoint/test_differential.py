"""Differential fuzzing of the checkpoint reader against the ``safetensors`` package.

ple-um must refuse every checkpoint whose table files safetensors (the loader stock vLLM uses)
refuses, and serve exactly the bytes safetensors reads where both accept. Three real checkpoints
are written by safetensors' own writer (``safetensors.torch.save_file``, which pads the header with
spaces to 8 bytes): FP8 rows with their scale and an index, BF16 rows without an index, NVFP4
packed rows with block scales and an index; each has a file of table tensors only, one that mixes
them with other tensors, and one without any. A case copies one checkpoint, applies one or two
mutations of ``MUTATIONS`` (the corpus; docs/CHECKPOINTS.md describes each), and opens the mutant
twice:

- ple-um: ``read_layout``, then ``open_table(mode="cpu")`` and a lookup of every row (NVFP4:
  ``lookup_packed``, the packed rows and their block scales);
- safetensors as installed: ``safe_open`` of every file ple-um must judge (the files the index names
  for a table tensor; without an index, every ``*.safetensors`` file), reading the table's tensors.

Asserted for every mutant:

1. ple-um refuses it (with a CheckpointError: any other exception fails) when safetensors refuses
   one of those files, or when the index cannot lead to the table (unreadable, no ``weight_map``
   object, a table entry naming no file inside the checkpoint).
2. Where ple-um accepts, its shards are exactly the layer's shard tensors safetensors lists in those
   files, every row it returns equals the bytes safetensors returns for it, and its scale is the
   value safetensors reads.
3. Where safetensors accepts every one of those files, the index is consistent and the table's
   tensors (names, files, dtypes, shapes, bytes) are the original's, ple-um accepts too.

16-bit rows at an odd byte offset (a header padded by an odd number of bytes) are no exception:
both readers accept them and ``open_table`` serves them.

Seeded: case ``i`` of seed ``s`` is the same mutant on every machine. CI runs ``DEFAULT_CASES``;
more on demand: ``pytest tests/checkpoint/test_differential.py --differential-cases 20000
--differential-seed 7`` (the options are declared in tests/conftest.py).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ple_um
from ple_um.checkpoint import read_layout
from ple_um.checkpoint.safetensors import read_header
from ple_um.errors import CheckpointError

DEFAULT_CASES = 400
DEFAULT_SEED = 0

LAYER = 1
TABLE = f"model.language_model.layers.{LAYER}.ple.ple_embedding.ngram_embedding."
INDEX = "model.safetensors.index.json"
FILES = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
# What the reference counts as the table: any tensor of the layer's n-gram embedding (any prefix).
TABLE_NAME = re.compile(rf"(?:^|\.)layers\.{LAYER}\.ple\.ple_embedding\.ngram_embedding\.")
SHARD_NAME = re.compile(rf"(?:^|\.)layers\.{LAYER}\.ple\.ple_embedding\.ngram_embedding\.shard_\d+\.weight\Z")
BLOCK_NAME = re.compile(
    rf"(?:^|\.)layers\.{LAYER}\.ple\.ple_embedding\.ngram_embedding\.shard_\d+\.weight_scale\Z"
)

SAFETENSORS_DTYPES = [
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16",
    "BF16", "I32", "U32", "F32", "I64", "U64", "F64", "C64", "F4", "F6_E2M3", "F6_E3M2",
]  # fmt: skip
UNKNOWN_DTYPES = ["XX", "f8_e4m3", "F8_E4M3FN", "C128", "", "BF16 "]


# ------------------------------------------------------------------ the original checkpoints


def _random(dtype: torch.dtype, shape: list[int], g: torch.Generator) -> torch.Tensor:
    count = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _tensors(kind: str, g: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """The tensors of FILES: table tensors (and others), table tensors only, no table tensor."""
    other = {"model.language_model.embed_tokens.weight": _random(torch.bfloat16, [11, 8], g)}
    rest = {
        "lm_head.weight": _random(torch.bfloat16, [11, 8], g),
        "model.language_model.norm.weight": torch.rand(8, generator=g),
    }
    if kind == "fp8":
        rows = [_random(torch.float8_e4m3fn, [r, 24], g) for r in (8, 8, 8, 5)]
        first = {f"{TABLE}shard_{i}.weight": rows[i] for i in (0, 1)}
        first[f"{TABLE}weight_scale"] = torch.tensor(0.0390625)
        return [{**other, **first}, {f"{TABLE}shard_{i}.weight": rows[i] for i in (2, 3)}, rest]
    if kind == "bf16":
        rows = [_random(torch.bfloat16, [r, 6], g) for r in (7, 7, 6)]
        return [
            {**other, f"{TABLE}shard_0.weight": rows[0]},
            {f"{TABLE}shard_{i}.weight": rows[i] for i in (1, 2)},
            rest,
        ]
    assert kind == "nvfp4"
    rows = [_random(torch.uint8, [r, 16], g) for r in (5, 4)]  # 32 E2M1 values a row
    blocks = [_random(torch.float8_e4m3fn, [r, 2], g) for r in (5, 4)]

    def shard(i: int) -> dict[str, torch.Tensor]:
        return {f"{TABLE}shard_{i}.weight": rows[i], f"{TABLE}shard_{i}.weight_scale": blocks[i]}

    first = {**other, **shard(0), f"{TABLE}weight_scale_2": torch.tensor(0.75)}
    return [first, shard(1), rest]


@dataclass
class Original:
    kind: str
    files: dict[str, bytes]  # file name -> content (the index too, when there is one)
    table: dict[str, list[tuple]]  # the table's tensors as safetensors reads them (see View.table)
    table_files: frozenset[str]  # the files that hold table tensors


KINDS = {"fp8": True, "bf16": False, "nvfp4": True}  # kind -> with an index


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Original]:
    found = {}
    for seed, (kind, indexed) in enumerate(KINDS.items()):
        directory = tmp_path_factory.mktemp(f"original-{kind}")
        g = torch.Generator().manual_seed(seed)
        weight_map = {}
        for name, tensors in zip(FILES, _tensors(kind, g), strict=True):
            save_file(tensors, str(directory / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
        if indexed:
            (directory / INDEX).write_text(
                json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
            )
        files = {name: (directory / name).read_bytes() for name in os.listdir(directory)}
        view = safetensors_view(str(directory))
        assert not view.must_refuse and not view.refused and view.index_consistent, view
        table_files = frozenset(os.path.basename(f) for entries in view.table.values() for f, *_ in entries)
        found[kind] = Original(kind, files, _comparable(view.table), table_files)
    return found


# ------------------------------------------------------------------ the reference: safetensors


@dataclass
class View:
    """What safetensors makes of a checkpoint directory."""

    refused: dict[str, str] = field(default_factory=dict)  # judged file -> safetensors' error
    must_refuse: list[str] = field(default_factory=list)  # why the checkpoint cannot serve a table
    # table tensor name -> [(path, dtype, shape, bytes or None when torch cannot hold the dtype)]
    table: dict[str, list[tuple]] = field(default_factory=dict)
    index_consistent: bool = True  # no index, or every entry names a file there that holds it


def _inside(directory: str, target: object) -> str | None:
    """The path an index entry names, when it is a regular file inside ``directory``."""
    if not isinstance(target, str) or not target or "\0" in target:
        return None
    path = os.path.normpath(os.path.join(directory, target))
    if not path.startswith(directory + os.sep) or not os.path.isfile(path):
        return None
    return path


def safetensors_view(directory: str) -> View:
    """The files of ``directory`` that hold the table, as the index (read as vLLM reads it) or the
    directory names them, opened with safetensors."""
    view = View()
    index_path = os.path.join(directory, INDEX)
    weight_map = None
    if os.path.lexists(index_path):
        try:
            with open(index_path, "rb") as f:
                weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
        except (ValueError, TypeError, KeyError, IndexError, RecursionError):
            pass
        if not isinstance(weight_map, dict):
            view.must_refuse.append("the index is unreadable or has no weight_map object")
            view.index_consistent = False
            return view
        judged = set()
        for name, target in weight_map.items():
            path = _inside(directory, target)
            if path is None:
                view.index_consistent = False
                if TABLE_NAME.search(name):
                    view.must_refuse.append(f"index entry {name} names {target!r}, no file of the checkpoint")
            elif TABLE_NAME.search(name):
                judged.add(path)
    else:
        judged = set(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))

    names_in: dict[str, set[str]] = {}
    for path in sorted(judged):
        try:
            with safe_open(path, framework="pt") as f:
                names_in[path] = set(f.keys())
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not TABLE_NAME.search(name):
                        continue
                    part = f.get_slice(name)
                    try:
                        data = f.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    except Exception:  # noqa: BLE001 - a dtype or shape torch cannot hold
                        data = None
                    view.table.setdefault(name, []).append((path, part.get_dtype(), part.get_shape(), data))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            view.refused[path] = f"{type(e).__name__}: {e}"
    if weight_map is not None:
        for name, target in weight_map.items():
            path = _inside(directory, target)
            if path is not None and TABLE_NAME.search(name) and name not in names_in.get(path, {name}):
                view.index_consistent = False  # the entry names a file that does not hold it
    return view


def _comparable(table: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    return {
        name: sorted(
            ((os.path.basename(p), dtype, list(shape), data) for p, dtype, shape, data in entries), key=repr
        )
        for name, entries in table.items()
    }


# ------------------------------------------------------------------ safetensors files, byte by byte


def split(blob: bytes) -> tuple[bytes, bytes] | None:
    """(header text, data section), when the length field fits the file."""
    if len(blob) < 8:
        return None
    (length,) = struct.unpack("<Q", blob[:8])
    if length > len(blob) - 8:
        return None
    return blob[8 : 8 + length], blob[8 + length :]


def parse(blob: bytes) -> tuple[dict, bytes] | None:
    parts = split(blob)
    if parts is None:
        return None
    try:
        header = json.loads(parts[0])
    except (ValueError, RecursionError):
        return None
    return (header, parts[1]) if isinstance(header, dict) else None


def assemble(text: bytes, data: bytes, *, pad: bytes = b" ") -> bytes:
    """A file of ``text`` padded with ``pad`` to 8 bytes (as safetensors writes it), then ``data``."""
    text += pad * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def render(pairs: list[tuple[str, object]], raw: dict[str, str] | None = None) -> bytes:
    """The JSON object of ``pairs`` (a key may repeat); wherever a key of ``raw`` stands as a string
    value (at any depth), ``raw[key]`` is written instead, verbatim JSON text (NaN, -0, lone
    surrogates, deep nesting, an object with a repeated key)."""
    text = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs) + "}"
    for sentinel, value in (raw or {}).items():
        text = text.replace(json.dumps(sentinel), value)
    return text.encode()


def _ints(meta: object, key: str, length: int | None = None) -> bool:
    """Whether entry ``meta`` has a list of integers under ``key`` (of ``length``, when given)."""
    value = meta.get(key) if isinstance(meta, dict) else None
    return (
        isinstance(value, list)
        and all(type(x) is int for x in value)
        and (length is None or len(value) == length)
    )


def entries(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def relayout(header: dict, data: bytes, order: list[str]) -> tuple[dict, bytes] | None:
    """The tensors of ``order`` laid out one after the other in that order (offsets rewritten)."""
    chunks, offset = [], 0
    header = dict(header)
    for name in order:
        if not _ints(header[name], "data_offsets", 2):
            return None
        start, end = header[name]["data_offsets"]
        if not 0 <= start <= end <= len(data):
            return None
        chunks.append(data[start:end])
        header[name] = {**header[name], "data_offsets": [offset, offset + end - start]}
        offset += end - start
    return header, b"".join(chunks)


# ------------------------------------------------------------------ the mutations

Mutation = Callable[[random.Random, dict[str, bytes], Original], str]


def _file(rng: random.Random, files: dict[str, bytes], original: Original) -> str:
    """A safetensors file of the checkpoint, those holding table tensors three times as likely."""
    names = sorted(n for n in files if n.endswith(".safetensors"))
    return rng.choices(names, weights=[3 if n in original.table_files else 1 for n in names])[0]


def _structured(rng, files, original) -> tuple[str, dict, bytes] | None:
    name = _file(rng, files, original)
    parsed = parse(files[name])
    return None if parsed is None else (name, *parsed)


def _tensor_entry(rng, files, original) -> tuple[str, dict, bytes, str] | None:
    """A structured file that names tensors, and one of its tensors picked at random, or None."""
    found = _structured(rng, files, original)
    if found is None or not entries(found[1]):
        return None
    return (*found, rng.choice(entries(found[1])))


def header_length(rng, files, original) -> str:
    """The header length field changed: by a few bytes (the issue's case, -1, drops a pad space),
    anywhere within the header, or to an extreme value."""
    name = _file(rng, files, original)
    blob = files[name]
    if len(blob) < 8:
        return header_byte(rng, files, original)
    (length,) = struct.unpack("<Q", blob[:8])
    roll = rng.random()
    if roll < 0.6:
        new = length + rng.choice([-3, -2, -1, 1, 2, 3])
    elif roll < 0.85:
        new = rng.randint(0, length + 64)
    else:
        new = rng.choice([0, 7, len(blob) - 8, len(blob) - 7, 100_000_001, 1 << 63, (1 << 64) - 1])
    new = min(max(new, 0), (1 << 64) - 1)
    files[name] = struct.pack("<Q", new) + blob[8:]
    return f"header_length({name}): {length} -> {new}"


HEADER_BYTES = b' {}[]":,0123456789-.eEtnN\t\n\\\x00\x7f\xff'


def header_byte(rng, files, original) -> str:
    """One byte of the header's JSON replaced: by a structural character, a digit, or any byte."""
    name = _file(rng, files, original)
    blob = bytearray(files[name])
    parts = split(bytes(blob))
    if parts is None or not parts[0]:
        return append(rng, files, original)
    at = 8 + rng.randrange(len(parts[0]))
    value = rng.choice(HEADER_BYTES) if rng.random() < 0.7 else rng.randrange(256)
    old, blob[at] = blob[at], value
    files[name] = bytes(blob)
    return f"header_byte({name}): byte {at} {old:#04x} -> {value:#04x}"


def header_splice(rng, files, original) -> str:
    """One byte inserted into or deleted from the header, the length field adjusted to match."""
    name = _file(rng, files, original)
    parts = split(files[name])
    if parts is None or not parts[0]:
        return truncate(rng, files, original)
    text, data = parts
    at = rng.randrange(len(text))
    if rng.random() < 0.5:
        text = text[:at] + bytes([rng.choice(HEADER_BYTES)]) + text[at:]
        what = "inserted"
    else:
        text = text[:at] + text[at + 1 :]
        what = "deleted"
    files[name] = struct.pack("<Q", len(text)) + text + data
    return f"header_splice({name}): a byte {what} at {at}"


def truncate(rng, files, original) -> str:
    """The file cut short: by a byte, by a few, or anywhere."""
    name = _file(rng, files, original)
    blob = files[name]
    size = rng.choice([len(blob) - 1, len(blob) - rng.randint(1, 16), rng.randrange(max(len(blob), 1))])
    files[name] = blob[: max(size, 0)]
    return f"truncate({name}): {len(blob)} -> {max(size, 0)} bytes"


def append(rng, files, original) -> str:
    """Bytes appended after the last tensor: zeros, spaces or random bytes."""
    name = _file(rng, files, original)
    count = rng.randint(1, 16)
    extra = rng.choice([b"\0" * count, b" " * count, bytes(rng.randrange(256) for _ in range(count))])
    files[name] += extra
    return f"append({name}): {count} bytes {extra[:4]!r}"


def data_byte(rng, files, original) -> str:
    """A byte of the data section changed: still a sound file, with other values."""
    name = _file(rng, files, original)
    parts = split(files[name])
    if parts is None or not parts[1]:
        return header_length(rng, files, original)
    at = len(files[name]) - len(parts[1]) + rng.randrange(len(parts[1]))
    blob = bytearray(files[name])
    blob[at] ^= rng.randint(1, 255)
    files[name] = bytes(blob)
    return f"data_byte({name}): byte {at}"


def repad(rng, files, original) -> str:
    """The header rewritten with other whitespace (indentation, padding of any length, before or
    after the object): still sound, but the data section now starts elsewhere, at any alignment.
    Sometimes the padding holds a byte JSON does not allow as whitespace."""
    found = _structured(rng, files, original)
    if found is None:
        return header_byte(rng, files, original)
    name, header, data = found
    text = json.dumps(header, indent=rng.choice([None, 1, "\t"])).encode()
    space = rng.choice([b" ", b"\t", b"\n", b"\r"])
    before, after = space * rng.randint(0, 3), space * rng.randint(0, 17)
    if rng.random() < 0.15:
        after += rng.choice([b"\0", b"\x0c", b"x", b"\xa0", b"\xc2\xa0"])
    text = before + text + after
    files[name] = struct.pack("<Q", len(text)) + text + data
    return f"repad({name}): {len(before)} bytes before, {after[:20]!r} after"


def offsets(rng, files, original) -> str:
    """data_offsets changed: one end moved, reversed, far away, or swapped with another tensor's."""
    found = _tensor_entry(rng, files, original)
    if found is None:
        return header_length(rng, files, original)
    name, header, data, tensor = found
    meta = header[tensor]
    if not _ints(meta, "data_offsets", 2):
        return header_byte(rng, files, original)
    start, end = meta["data_offsets"]
    roll = rng.random()
    if roll < 0.45:
        delta = rng.choice([-8, -2, -1, 1, 2, 8, 24])
        which = rng.choice(["start", "end", "both"])
        start += delta if which != "end" else 0
        end += delta if which != "start" else 0
        what = f"{which} {delta:+d}"
    elif roll < 0.55:
        start, end, what = end, start, "reversed"
    elif roll < 0.65:
        start, end, what = start + (1 << 40), end + (1 << 40), "+2**40"
    else:
        other = rng.choice(entries(header))
        if not _ints(header[other], "data_offsets", 2):
            return header_byte(rng, files, original)
        start, end = header[other]["data_offsets"]
        header[other] = {**header[other], "data_offsets": meta["data_offsets"]}
        what = f"swapped with {other}"
    header[tensor] = {**meta, "data_offsets": [start, end]}
    files[name] = assemble(json.dumps(header).encode(), data)
    return f"offsets({name}, {tensor}): {what}"


def shape(rng, files, original) -> str:
    """A shape changed: a dimension off by one, dimensions swapped or merged or split, an extra
    dimension, a zero, the 64-bit limits, and numbers no shape may hold (-0, 4.0)."""
    found = _tensor_entry(rng, files, original)
    if found is None:
        return header_length(rng, files, original)
    name, header, data, tensor = found
    meta = header[tensor]
    if not _ints(meta, "shape") or not meta["shape"]:
        return header_byte(rng, files, original)
    dims = list(meta["shape"])
    raw = {}
    roll = rng.randrange(9)
    if roll == 0:
        at = rng.randrange(len(dims))
        dims[at] += rng.choice([-1, 1])
    elif roll == 1:
        dims.reverse()
    elif roll == 2:
        dims = [int(np.prod(dims))]
    elif roll == 3:
        dims = [*dims, 1]
    elif roll == 4 and dims[-1] % 2 == 0:
        dims = [*dims[:-1], 2, dims[-1] // 2]
    elif roll == 5:
        dims[rng.randrange(len(dims))] = 0
    elif roll == 6:
        dims[rng.randrange(len(dims))] = rng.choice([(1 << 64) - 1, 1 << 64, 1 << 32])
    elif roll == 7:
        dims[rng.randrange(len(dims))] = "\x00raw"
        raw["\x00raw"] = rng.choice(["-0", "4.0", "1e1", "-1", "true", "null"])
    else:
        dims = [0, (1 << 64) - 1] if rng.random() < 0.5 else [1 << 40, 1 << 40, 0]
    header[tensor] = {**meta, "shape": dims}
    files[name] = assemble(render(list(header.items()), raw), data)
    return f"shape({name}, {tensor}): {meta['shape']} -> {dims} {raw}"


def dtype(rng, files, original) -> str:
    """A dtype replaced by another one safetensors knows (same size or not), or by one it does not."""
    found = _tensor_entry(rng, files, original)
    if found is None:
        return header_length(rng, files, original)
    name, header, data, tensor = found
    if not isinstance(header[tensor], dict):
        return header_byte(rng, files, original)
    new = rng.choice(SAFETENSORS_DTYPES) if rng.random() < 0.8 else rng.choice(UNKNOWN_DTYPES)
    old = header[tensor].get("dtype")
    header[tensor] = {**header[tensor], "dtype": new}
    files[name] = assemble(json.dumps(header).encode(), data)
    return f"dtype({name}, {tensor}): {old} -> {new!r}"


METADATA = [
    ({"format": "pt"}, True),
    (None, True),
    ({"format": "pt", "note": "\u00e9\U0001f600"}, True),
    ({"n": 1}, False),
    ({"list": ["a"]}, False),
    ({"null": None}, False),
    ([], False),
    ("pt", False),
]


def metadata(rng, files, original) -> str:
    """__metadata__ replaced (objects of strings, null, other JSON), or named twice."""
    found = _structured(rng, files, original)
    if found is None:
        return header_byte(rng, files, original)
    name, header, data = found
    value, _ = rng.choice(METADATA)
    pairs = [(k, v) for k, v in header.items() if k != "__metadata__"]
    pairs.insert(0, ("__metadata__", value))
    twice = rng.random() < 0.2
    if twice:
        pairs.append(("__metadata__", {"format": "pt"}))
    files[name] = assemble(render(pairs), data)
    return f"metadata({name}): {value!r}{' and again' if twice else ''}"


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


EXTRA_VALUES = [  # (raw JSON, whether safetensors accepts it in a field it does not know)
    ('"text"', True),
    ("-1", True),
    ("18446744073709551616", True),
    ("1e300", True),
    ("1e-400", True),
    ('[1, [2, {"a": null}]]', True),
    ('"\\ud83d\\ude00"', True),
    (_nested(125), True),
    ("NaN", False),
    ("Infinity", False),
    ("-Infinity", False),
    ("1e400", False),
    ("1" + "0" * 400, False),
    (_nested(126), False),
    ('"\\ud800"', False),
    ('"x\\udc00"', False),
]


def extra_field(rng, files, original) -> str:
    """A field safetensors does not know added to a tensor entry, with any JSON value; serde_json
    refuses some values Python's json takes (NaN, 1e400, nesting past 127, lone surrogates)."""
    found = _tensor_entry(rng, files, original)
    if found is None:
        return header_byte(rng, files, original)
    name, header, data, tensor = found
    if not isinstance(header[tensor], dict):
        return header_byte(rng, files, original)
    text, _ = rng.choice(EXTRA_VALUES)
    key = rng.choice(["extra", "dtype_hint", "\u00e9"])
    entry_pairs = [*header[tensor].items(), (key, "\x00raw")]
    rng.shuffle(entry_pairs)
    header[tensor] = dict(entry_pairs)
    files[name] = assemble(render(list(header.items()), {"\x00raw": text}), data)
    return f"extra_field({name}, {tensor}): {key}={text[:30]}"


def repeat(rng, files, original) -> str:
    """A tensor named twice (safetensors keeps the last entry but parses both): an identical copy,
    another sound entry, a malformed one, before or after; or a field repeated inside an entry."""
    found = _tensor_entry(rng, files, original)
    if found is None:
        return header_byte(rng, files, original)
    name, header, data, tensor = found
    meta = header[tensor]
    if not isinstance(meta, dict):
        return header_byte(rng, files, original)
    pairs = list(header.items())
    at = [k for k, _ in pairs].index(tensor)
    roll = rng.randrange(6)
    if roll == 0:
        copy, what = dict(meta), "identical copy"
    elif roll == 1:
        other = header[rng.choice(entries(header))]
        copy, what = (dict(other) if isinstance(other, dict) else {}), "another tensor's entry"
    elif roll == 2:
        copy, what = {"dtype": meta.get("dtype")}, "malformed copy"
    elif roll == 3:
        copy, what = {**meta, "dtype": "XX"}, "copy with an unknown dtype"
    elif roll == 4:
        copy, what = {**meta, "data_offsets": [0, 0], "shape": [0]}, "empty copy"
    else:
        field_name = rng.choice(["dtype", "shape", "data_offsets", "extra"])
        inner = render([*meta.items(), (field_name, meta.get(field_name, 1))]).decode()
        pairs[at] = (tensor, "\x00entry")  # an object with a repeated key: written as text
        files[name] = assemble(render(pairs, {"\x00entry": inner}), data)
        return f"repeat({name}, {tensor}): field {field_name} twice"
    if rng.random() < 0.5:
        pairs.insert(at, (tensor, copy))
        where = "before"
    else:
        pairs.insert(at + 1, (tensor, copy))
        where = "after"
    files[name] = assemble(render(pairs), data)
    return f"repeat({name}, {tensor}): {what} {where}"


def rename(rng, files, original) -> str:
    """A tensor renamed: another shard index, a leading zero, another layer, another prefix."""
    found = _tensor_entry(rng, files, original)
    if found is None:
        return header_byte(rng, files, original)
    name, header, data, tensor = found
    choices = [
        re.sub(r"shard_(\d+)", lambda m: f"shard_{int(m.group(1)) + 1}", tensor),
        re.sub(r"shard_(\d+)", lambda m: f"shard_0{m.group(1)}", tensor),
        tensor.replace(f"layers.{LAYER}.", f"layers.{LAYER + 1}."),
        tensor.replace("model.language_model.", "model."),
        tensor + "_",
    ]
    new = rng.choice(choices)
    files[name] = assemble(render([(new if k == tensor else k, v) for k, v in header.items()]), data)
    return f"rename({name}): {tensor} -> {new}"


def add_entry(rng, files, original) -> str:
    """A tensor added: covering bytes appended for it, overlapping another, or empty at the end, at
    a boundary between two tensors or inside one."""
    found = _structured(rng, files, original)
    if found is None:
        return header_byte(rng, files, original)
    name, header, data = found
    roll = rng.randrange(4)
    if roll == 0:
        count = rng.randint(1, 9)
        entry = {"dtype": "U8", "shape": [count], "data_offsets": [len(data), len(data) + count]}
        data += bytes(range(count))
        what = f"{count} bytes appended for it"
    elif roll == 1:
        start = rng.randrange(max(len(data), 1))
        end = min(start + rng.randint(1, 4), len(data))
        entry = {"dtype": "U8", "shape": [end - start], "data_offsets": [start, end]}
        what = f"over bytes {start}..{end}"
    else:
        cuts = sorted(
            {m["data_offsets"][0] for m in header.values() if _ints(m, "data_offsets", 2)} | {len(data)}
        )
        at = rng.choice(cuts) if roll == 2 else rng.randrange(len(data) + 1)
        entry = {"dtype": "F32", "shape": [0, 3], "data_offsets": [at, at]}
        what = f"empty at byte {at}"
    pairs = list(header.items())
    pairs.insert(rng.randint(0, len(pairs)), ("added.weight", entry))
    files[name] = assemble(render(pairs), data)
    return f"add_entry({name}): {what}"


def data_gap(rng, files, original) -> str:
    """Bytes inserted into the data section where a tensor begins: the later offsets moved past
    them (a hole), moved and the gap given to a new tensor (sound), or not moved at all (every
    later tensor now reads shifted bytes)."""
    found = _structured(rng, files, original)
    if found is None:
        return header_byte(rng, files, original)
    name, header, data = found
    starts = sorted({m["data_offsets"][0] for m in header.values() if _ints(m, "data_offsets", 2)})
    at = rng.choice(starts or [0])
    count = rng.choice([1, 2, 7, 8, 16])
    data = data[:at] + b"\0" * count + data[at:]
    mode = rng.choice(["hole", "filled", "unmoved"])
    if mode != "unmoved":
        for key, meta in header.items():
            if _ints(meta, "data_offsets", 2) and meta["data_offsets"][0] >= at:
                start, end = meta["data_offsets"]
                header[key] = {**meta, "data_offsets": [start + count, end + count]}
    if mode == "filled":
        header["padding.bytes"] = {"dtype": "U8", "shape": [count], "data_offsets": [at, at + count]}
    files[name] = assemble(json.dumps(header).encode(), data)
    return f"data_gap({name}): {count} bytes at {at}, {mode}"


def reorder(rng, files, original) -> str:
    """The tensors' data laid out in another order (offsets rewritten), the entries listed in
    another order, or a tensor left out (its bytes too, or its bytes left as a hole)."""
    found = _structured(rng, files, original)
    if found is None or not entries(found[1]):
        return header_byte(rng, files, original)
    name, header, data = found
    names = entries(header)
    roll = rng.randrange(4)
    if roll == 0:
        rng.shuffle(names)
        laid = relayout(header, data, names)
        if laid is None:
            return header_byte(rng, files, original)
        header, data = laid
        what = "data reordered"
    elif roll == 1:
        items = list(header.items())
        rng.shuffle(items)
        header = dict(items)
        what = "entries reordered"
    else:
        gone = rng.choice(names)
        names.remove(gone)
        if roll == 2:
            laid = relayout(header, data, names)
            if laid is None:
                return header_byte(rng, files, original)
            header, data = laid
            what = f"{gone} left out with its bytes"
        else:
            what = f"{gone} left out, its bytes kept"
        header.pop(gone)
    files[name] = assemble(json.dumps(header).encode(), data)
    return f"reorder({name}): {what}"


def index_entries(rng, files, original) -> str:
    """The index changed: a table entry dropped, sent to another file, a missing file, a path
    outside the checkpoint or no string; two entries' files swapped; another tensor's entry sent
    to a missing file or outside; the weight_map broken; the index removed or its bytes corrupted."""
    if INDEX not in files:
        return header_length(rng, files, original)
    try:
        index = json.loads(files[INDEX])
        weight_map = index["weight_map"]
        assert isinstance(weight_map, dict) and weight_map
    except (ValueError, KeyError, TypeError, AssertionError):
        return header_length(rng, files, original)
    table = sorted(k for k in weight_map if TABLE_NAME.search(k)) or sorted(weight_map)
    others = sorted(k for k in weight_map if not TABLE_NAME.search(k)) or table
    roll = rng.randrange(9)
    if roll == 0:
        entry = rng.choice(table)
        del weight_map[entry]
        what = f"{entry} dropped"
    elif roll in (1, 2):
        entry = rng.choice(table)
        target = rng.choice(
            [*FILES, "missing.safetensors", "../" + FILES[0], "", 7, None, "sub/../" + FILES[1]]
        )
        weight_map[entry] = target
        what = f"{entry} -> {target!r}"
    elif roll == 3:
        a, b = rng.choice(table), rng.choice(list(weight_map))
        weight_map[a], weight_map[b] = weight_map[b], weight_map[a]
        what = f"{a} and {b} swapped"
    elif roll == 4:
        entry = rng.choice(others)
        weight_map[entry] = rng.choice(["missing.safetensors", "/abs/x.safetensors"])
        what = f"{entry} -> {weight_map[entry]!r}"
    elif roll == 5:
        index["weight_map"] = rng.choice([[], None, "x", {}])
        what = f"weight_map -> {index['weight_map']!r}"
    elif roll == 6:
        del files[INDEX]
        return "index_entries: index removed"
    elif roll == 7:
        blob = files[INDEX]
        files[INDEX] = blob[: rng.randrange(len(blob))]
        return "index_entries: index truncated"
    else:
        weight_map[f"{TABLE}shard_9.weight"] = rng.choice(FILES)
        what = "an entry for a tensor no file holds"
    files[INDEX] = json.dumps(index).encode()
    return f"index_entries: {what}"


MUTATIONS: dict[str, tuple[Mutation, int]] = {  # name -> (mutation, weight)
    "header_length": (header_length, 6),
    "header_byte": (header_byte, 4),
    "header_splice": (header_splice, 2),
    "truncate": (truncate, 3),
    "append": (append, 2),
    "data_byte": (data_byte, 2),
    "repad": (repad, 4),
    "offsets": (offsets, 4),
    "shape": (shape, 4),
    "dtype": (dtype, 3),
    "metadata": (metadata, 2),
    "extra_field": (extra_field, 3),
    "repeat": (repeat, 3),
    "rename": (rename, 2),
    "add_entry": (add_entry, 3),
    "data_gap": (data_gap, 3),
    "reorder": (reorder, 3),
    "index_entries": (index_entries, 4),
}


# ------------------------------------------------------------------ ple-um's side


@dataclass
class Served:
    layout: object
    rows: np.ndarray  # uint8 [num_rows, row_bytes]
    block_rows: np.ndarray | None  # NVFP4: uint8 [num_rows, row_dim // 16]


def ple_um_open(directory: str) -> Served | str:
    """The rows ple-um serves, or its refusal (the CheckpointError's text)."""
    try:
        layout = read_layout(directory, LAYER)
    except CheckpointError as e:
        return str(e)
    with ple_um.open_table(directory, layer=LAYER, mode="cpu") as table:
        ids = torch.arange(layout.num_rows)
        if layout.is_nvfp4:
            packed, scales = table.lookup_packed(ids)
            return Served(
                layout, packed.view(torch.uint8).cpu().numpy(), scales.view(torch.uint8).cpu().numpy()
            )
        return Served(layout, table.lookup(ids).view(torch.uint8).cpu().numpy(), None)


def _expected_rows(view: View, specs, row_bytes: int, dtype: str) -> np.ndarray:
    """The rows of ``specs`` (shard specs in index order) from the bytes safetensors read."""
    chunks = []
    for spec in specs:
        found = view.table.get(spec.tensor, [])
        assert len(found) == 1, f"{spec.tensor}: safetensors lists it {len(found)} times in the judged files"
        path, st_dtype, st_shape, data = found[0]
        assert path == spec.path, (spec, path)
        assert st_dtype == dtype, (spec.tensor, st_dtype, dtype)
        assert st_shape[0] == spec.rows and data is not None and len(data) == spec.rows * row_bytes, found[0][
            :3
        ]
        chunks.append(data)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).reshape(-1, row_bytes)


def check_served(served: Served, view: View) -> None:
    """Assertion 2: ple-um's shards are safetensors' shard tensors, its rows their bytes."""
    layout = served.layout
    shard_names = {n for n in view.table if SHARD_NAME.search(n)}
    assert {s.tensor for s in layout.shards} == shard_names, (
        "ple-um's shards are not safetensors' shard tensors"
    )
    storage = "U8" if layout.is_nvfp4 else layout.dtype_name
    expected = _expected_rows(view, layout.shards, layout.row_bytes, storage)
    assert expected.shape[0] == layout.num_rows
    if layout.is_nvfp4:
        assert {s.tensor for s in layout.block_scales} == {n for n in view.table if BLOCK_NAME.search(n)}
        width = layout.row_dim // layout.block_size
        blocks = _expected_rows(view, layout.block_scales, width, "F8_E4M3")
    assert np.array_equal(served.rows, expected), "a row ple-um serves differs from safetensors' bytes"
    if layout.is_nvfp4:
        assert np.array_equal(served.block_rows, blocks), "NVFP4 block scales differ from safetensors' bytes"
    if layout.scale is not None:
        [(path, *_)] = view.table[layout.scale_tensor]
        with safe_open(path, framework="pt") as f:
            value = f.get_tensor(layout.scale_tensor).float().reshape(-1)
        assert value.numel() == 1 and value.item() == layout.scale, (value, layout.scale)


# ------------------------------------------------------------------ the cases


@dataclass
class Outcome:
    ple_um: str  # "served" or "refused"
    safetensors: str  # "accepts" or "refuses"
    unchanged: bool  # the table, its files and the index as in the original


def check_files(directory: str) -> None:
    """Every file on its own: ple-um's header reader refuses it exactly where safetensors does."""
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors"))):
        try:
            with safe_open(path, framework="pt"):
                pass
            theirs = None
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            theirs = f"{type(e).__name__}: {e}"
        try:
            read_header(path)
            ours = None
        except CheckpointError as e:
            ours = str(e)
        assert (theirs is None) == (ours is None), (
            f"{os.path.basename(path)}: safetensors {theirs}, ple-um {ours}"
        )


def run_case(directory: str, original: Original) -> Outcome:
    check_files(directory)
    view = safetensors_view(directory)
    result = ple_um_open(directory)
    refuses = bool(view.must_refuse or view.refused)
    unchanged = not refuses and view.index_consistent and _comparable(view.table) == original.table
    if isinstance(result, str):
        assert not unchanged, f"ple-um refused a checkpoint safetensors reads as the original: {result}"
        return Outcome("refused", "refuses" if refuses else "accepts", unchanged)
    assert not refuses, f"ple-um accepted what safetensors refuses: {view.must_refuse} {view.refused}"
    check_served(result, view)
    return Outcome("served", "accepts", unchanged)


def mutate(rng: random.Random, files: dict[str, bytes], original: Original) -> list[str]:
    names = list(MUTATIONS)
    weights = [MUTATIONS[n][1] for n in names]
    done = []
    for _ in range(2 if rng.random() < 0.15 else 1):
        done.append(MUTATIONS[rng.choices(names, weights=weights)[0]][0](rng, files, original))
    return done


def test_originals_are_served_as_safetensors_reads_them(originals, tmp_path):
    for kind, original in originals.items():
        directory = tmp_path / kind
        directory.mkdir()
        for name, blob in original.files.items():
            (directory / name).write_bytes(blob)
        outcome = run_case(str(directory), original)
        assert (outcome.ple_um, outcome.safetensors, outcome.unchanged) == ("served", "accepts", True), kind


def test_differential_against_safetensors(originals, tmp_path, request):
    cases = request.config.getoption("--differential-cases") or DEFAULT_CASES
    seed = request.config.getoption("--differential-seed")
    seed = DEFAULT_SEED if seed is None else seed
    outcomes: Counter = Counter()
    kinds: dict[str, Counter] = {name: Counter() for name in MUTATIONS}
    for case in range(cases):
        rng = random.Random(f"{seed}:{case}")
        original = originals[rng.choice(sorted(originals))]
        files = dict(original.files)
        done = mutate(rng, files, original)
        directory = tmp_path / f"case{case}"
        directory.mkdir()
        for name, blob in files.items():
            (directory / name).write_bytes(blob)
        try:
            outcome = run_case(str(directory), original)
        except Exception as e:
            raise AssertionError(
                f"case {case} of seed {seed} ({original.kind}): {'; '.join(done)}\n"
                f"rerun: pytest {__file__} --differential-seed {seed} --differential-cases {case + 1}"
            ) from e
        shutil.rmtree(directory)
        key = (outcome.safetensors, outcome.ple_um, "unchanged" if outcome.unchanged else "changed")
        outcomes[key] += 1
        for description in done:
            kinds[description.split("(")[0].split(":")[0]][key[:2]] += 1
    summary = "\n".join(
        f"  safetensors {a}, ple-um {b}, table {c}: {n}" for (a, b, c), n in sorted(outcomes.items())
    )
    print(f"\n{cases} cases of seed {seed}:\n{summary}")
    for name, counts in kinds.items():
        print(
            f"  {name}: "
            + ", ".join(f"safetensors {a} / ple-um {b}: {n}" for (a, b), n in sorted(counts.items()))
        )
    # Not vacuous: both verdicts occur, and ple-um serves mutants safetensors accepts.
    if cases >= DEFAULT_CASES:
        assert outcomes[("refuses", "refused", "changed")] >= cases // 5, outcomes
        assert sum(n for (a, b, _), n in outcomes.items() if a == "accepts" and b == "served") >= cases // 10
        assert all(sum(counts.values()) for counts in kinds.values()), kinds


# ------------------------------------------------------------------ safetensors' rules, one case each

RULE_TABLE = [(f"{TABLE}shard_{i}.weight", "F8_E4M3", [r, 4]) for i, r in enumerate((3, 3, 2))]
RULE_TABLE += [(f"{TABLE}weight_scale", "F32", []), ("other.weight", "U8", [4])]
FIRST, SHARD_1, LAST = RULE_TABLE[0][0], RULE_TABLE[1][0], RULE_TABLE[-1][0]


def _rule_file() -> tuple[list[tuple[str, object]], bytes]:
    """A sound one-file FP8 table: the header's (name, entry) pairs, and the data section."""
    pairs, data = [], b""
    for k, (name, dt, dims) in enumerate(RULE_TABLE):
        if dt == "F32":
            raw = struct.pack("<f", 0.5)
        else:
            raw = bytes((16 * k + j) % 0x70 for j in range(int(np.prod(dims))))
        pairs.append((name, {"dtype": dt, "shape": dims, "data_offsets": [len(data), len(data) + len(raw)]}))
        data += raw
    return pairs, data


def _changed(index: int, raw: dict[str, str] | None = None, *, data: bytes | None = None, **changes) -> bytes:
    """The rule file with entry ``index`` changed (a value that is a key of ``raw`` goes in verbatim)."""
    pairs, sound = _rule_file()
    pairs[index] = (pairs[index][0], {**pairs[index][1], **changes})
    return assemble(render(pairs, raw), sound if data is None else data)


def _added(*extra: tuple[str, object], first: tuple[str, object] | None = None, data: bytes = b"") -> bytes:
    """The rule file with ``extra`` entries after its own (``first`` before them), ``data`` appended."""
    pairs, sound = _rule_file()
    return assemble(render([*([first] if first else []), *pairs, *extra]), sound + data)


def _tensor(name: str, dt: str, dims: list[int], raw: bytes) -> bytes:
    """The rule file with one more tensor at its end."""
    size = len(_rule_file()[1])
    return _added((name, {"dtype": dt, "shape": dims, "data_offsets": [size, size + len(raw)]}), data=raw)


def _rules():
    pairs, data = _rule_file()
    size = len(data)
    text = render(pairs)
    yield "sound", assemble(text, data), True, None
    shifted = assemble(text, data)
    (length,) = struct.unpack("<Q", shifted[:8])
    assert shifted[8 + length - 1] == ord(" ")  # the pad space the shifted header gives to the data
    yield "header length one short", struct.pack("<Q", length - 1) + shifted[8:], False, LAST
    yield "header padded with 9 more spaces", assemble(text + b" " * 9, data), True, None
    yield "a byte after the last tensor", assemble(text, data + b"\0"), False, LAST
    hole = _changed(4, data_offsets=[size - 3, size + 1], data=data + b"\0")
    yield "a hole before a tensor", hole, False, LAST
    yield "the first tensor after byte 0", _changed(0, data_offsets=[1, 13], data=b"\0" + data), False, FIRST
    empty = {"dtype": "F32", "shape": [0, 3]}
    yield "an empty tensor at a boundary", _added(("e", {**empty, "data_offsets": [12, 12]})), True, None
    yield "an empty tensor inside another", _added(("e", {**empty, "data_offsets": [5, 5]})), False, "e"
    dropped = {"dtype": "U8", "shape": [0], "data_offsets": [99, 99]}
    yield "a name twice, the earlier entry sound", _added(first=(SHARD_1, dropped)), True, None
    malformed = {"dtype": "XX", "shape": [1], "data_offsets": [0, 1]}
    yield "a name twice, the earlier entry malformed", _added(first=(SHARD_1, malformed)), False, SHARD_1
    yield "__metadata__ twice", _added(("__metadata__", {}), first=("__metadata__", {})), False, None
    twice = render([*pairs[1][1].items(), ("dtype", "F8_E4M3")]).decode()
    repeated = assemble(render([pairs[0], (SHARD_1, "\x00e"), *pairs[2:]], {"\x00e": twice}), data)
    yield "an entry naming dtype twice", repeated, False, SHARD_1
    for value, accepted in METADATA:
        yield f"__metadata__ {value!r}", _added(first=("__metadata__", value)), accepted, None
    for raw, accepted in EXTRA_VALUES:
        case = _changed(1, {"\x00raw": raw}, extra="\x00raw")
        yield f"an unknown field of value {raw[:24]}", case, accepted, None if accepted else SHARD_1
    yield "-0 as an offset", _changed(0, {"\x00z": "[-0, 12]"}, data_offsets="\x00z"), False, FIRST
    yield "4.0 as a dimension", _changed(4, {"\x00z": "[4.0]"}, shape="\x00z"), False, LAST
    yield "dimension 2**64-1 of an empty tensor", _tensor("x", "U8", [0, (1 << 64) - 1], b""), True, None
    yield "dimension 2**64 of an empty tensor", _tensor("x", "U8", [0, 1 << 64], b""), False, "x"
    yield "a size that overflows before a zero", _tensor("x", "U8", [1 << 32, 1 << 32, 0], b""), False, "x"
    yield (
        "a zero before a size that would overflow",
        _tensor("x", "U8", [0, 1 << 32, 1 << 32], b""),
        True,
        None,
    )
    yield "a bit count that overflows", _tensor("x", "F64", [1 << 58], b""), False, "x"
    for name, nbytes in (("F8_E4M3FNUZ", 2), ("F8_E5M2FNUZ", 2), ("F8_E8M0", 2), ("BOOL", 2), ("U64", 16)):
        yield f"dtype {name}", _tensor("x", name, [2], b"\0" * nbytes), True, None
    yield "dtype F6_E2M3 of 4 values", _tensor("x", "F6_E2M3", [4], b"\0" * 3), True, None
    yield "dtype F4 of 3 values (half a byte)", _tensor("x", "F4", [3], b"\0\0"), False, "x"
    for name in ("XX", "f8_e4m3", "F8_E4M3FN", "C128"):
        yield f"unknown dtype {name}", _tensor("x", name, [2], b"\0\0"), False, "x"


RULES = list(_rules())


@pytest.mark.parametrize("case", RULES, ids=[c[0] for c in RULES])
def test_rules_of_the_installed_safetensors(tmp_path, case):
    """Each rule of safetensors (docs/CHECKPOINTS.md) on a file that holds a table: the installed
    package gives the verdict the docs state, and read_layout the same one, a refusal naming the
    file (and the tensor, where one is at fault)."""
    _, blob, accepted, tensor = case
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    try:
        with safe_open(str(path), framework="pt"):
            pass
        theirs = True
    except Exception:  # noqa: BLE001 - safetensors raises its own error types
        theirs = False
    assert theirs == accepted, "the installed safetensors no longer gives the verdict the docs state"
    if accepted:
        assert read_layout(str(tmp_path)).num_rows == 8
        return
    with pytest.raises(CheckpointError) as info:
        read_layout(str(tmp_path))
    assert info.value.path == str(path) and info.value.tensor == tensor, str(info.value)


def test_16bit_rows_at_an_odd_offset_are_read(tmp_path):
    """A header padded by one byte puts BF16 rows at an odd offset: safetensors accepts the file, so
    does the checkpoint layer, and the cpu mode serves its rows bit for bit."""
    rows = torch.arange(24, dtype=torch.bfloat16).reshape(6, 4)
    path = tmp_path / "model.safetensors"
    save_file({f"{TABLE}shard_0.weight": rows[:3], f"{TABLE}shard_1.weight": rows[3:]}, str(path))
    text, data = split(path.read_bytes())
    path.write_bytes(struct.pack("<Q", len(text) + 1) + text + b" " + data)
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor(f"{TABLE}shard_1.weight"), rows[3:])
    layout = read_layout(str(tmp_path))
    assert [s.offset % 2 for s in layout.shards] == [1, 1] and layout.num_rows == 6
    with ple_um.open_table(str(tmp_path), mode="cpu") as table:
        out = table.lookup(torch.tensor([5, 0, 3, 2, -1, 6]))
    expect = torch.cat((rows[[5, 0, 3, 2]], torch.zeros(2, 4, dtype=torch.bfloat16)))
    assert torch.equal(out.view(torch.int16), expect.view(torch.int16))
