"""NVFP4 tables in ple_um.checkpoint.validation: every way such a checkpoint can be refused, and
validate listing every problem, going on to the block scales when the rows are unsound."""

from __future__ import annotations

import json
import struct

import pytest
from helpers.hand_checkpoints import (
    UNRELATED,
    block,
    changed,
    global_name,
    nvfp4,
    one_file,
    raises,
    scalar,
    scale_name,
    shard,
    without,
)
from helpers.reference import encode_safetensors, write_raw, write_safetensors

from ple_um.checkpoint import read_layout, validate
from ple_um.errors import CheckpointError

CASES = [
    # (id, tensors, match, tensor named)
    (
        "block_scales_missing",
        lambda: without(nvfp4(), block(1)),
        r"NVFP4 shard 1 without its block scales; no such tensor in any file",
        block(1),
    ),
    (
        "block_scales_missing_for_empty_shard",
        lambda: without(nvfp4(), block(3)),
        r"NVFP4 shard 3 without its block scales",
        block(3),
    ),
    (
        "block_scales_without_rows",
        lambda: nvfp4() | {block(4): ("F8_E4M3", [0, 2], b"")},
        r"block scales of shard 4 without its rows: no tensor " + shard(4).replace(".", r"\."),
        block(4),
    ),
    (
        "block_rows",
        lambda: changed(nvfp4(), block(1), shape=[2, 2], data=b"\0" * 4),
        r"block scales of shard 1 have 2 rows, its row shard " + shard(1).replace(".", r"\.") + " has 3",
        block(1),
    ),
    (
        "block_width",
        lambda: changed(nvfp4(), block(0), shape=[3, 4], data=b"\0" * 12),
        r"block-scale width 4, expected 2: one scale per 16 of the 32 values of a row \(16 packed bytes\)",
        block(0),
    ),
    (
        "block_width_one_scale_per_byte",
        lambda: changed(nvfp4(rows=(2, 2)), block(1), shape=[2, 16], data=b"\0" * 32),
        r"block-scale width 16, expected 2",
        block(1),
    ),
    (
        "block_dtype_e5m2",
        lambda: changed(nvfp4(), block(2), dtype="F8_E5M2"),
        r"block-scale dtype F8_E5M2, expected F8_E4M3",
        block(2),
    ),
    (
        "block_dtype_u8",
        lambda: changed(nvfp4(), block(0), dtype="U8"),
        r"block-scale dtype U8, expected F8_E4M3",
        block(0),
    ),
    (
        "block_dtype_bf16",
        lambda: changed(nvfp4(), block(0), dtype="BF16", shape=[3, 1]),
        r"block-scale dtype BF16, expected F8_E4M3",
        block(0),
    ),
    (
        "block_one_d",
        lambda: changed(nvfp4(), block(1), shape=[6]),
        r"block-scale tensor has shape \[6\], expected 2-D",
        block(1),
    ),
    (
        "width_not_a_multiple_of_16",
        lambda: changed(
            changed(nvfp4(rows=(2, 2), dim=16), shard(0), shape=[2, 12], data=b"\0" * 24),
            shard(1),
            shape=[2, 12],
            data=b"\1" * 24,
        ),
        r"NVFP4 rows of 24 values \(12 packed bytes\) do not split into blocks of 16: the packed "
        r"width must be a multiple of 8",
        shard(0),
    ),
    (
        "width_odd",
        lambda: changed(
            changed(nvfp4(rows=(1, 1), dim=16), shard(0), shape=[1, 3], data=b"\0" * 3),
            shard(1),
            shape=[1, 3],
            data=b"\1" * 3,
        ),
        r"NVFP4 rows of 6 values \(3 packed bytes\)",
        shard(0),
    ),
    ("zero_width", lambda: nvfp4(rows=(2, 2), dim=0), r"rows have 0 elements", shard(0)),
    ("zero_rows", lambda: nvfp4(rows=(0, 0)), r"layer 1: the table has 0 rows", shard(0)),
    (
        "global_missing",
        lambda: nvfp4(global_scale=None),
        r"NVFP4 table without its global scale weight_scale_2; no such tensor in any file",
        global_name(),
    ),
    (
        "global_missing_fp8_scale_present",
        lambda: nvfp4(global_scale=None) | {scale_name(): ("F32", [], scalar("F32", 0.5))},
        r"unsharded weight_scale next to an NVFP4 table: its block scales must be stored per shard",
        scale_name(),
    ),
    (
        "unsharded_weight_scale",
        lambda: nvfp4() | {scale_name(): ("F8_E4M3", [9, 2], b"\0" * 18)},
        r"unsharded weight_scale next to an NVFP4 table",
        scale_name(),
    ),
    (
        "global_f64",
        lambda: nvfp4(global_scale=("F64", [], 0.5)),
        r"global scale dtype F64 is not one of F32, BF16, F16",
        global_name(),
    ),
    (
        "global_e4m3",
        lambda: nvfp4() | {global_name(): ("F8_E4M3", [], b"\x38")},
        r"global scale dtype F8_E4M3 is not one of",
        global_name(),
    ),
    (
        "global_shape_2",
        lambda: nvfp4() | {global_name(): ("F32", [2], b"\0" * 8)},
        r"global scale shape \[2\] is not \[\] or \[1\]",
        global_name(),
    ),
    (
        "global_shape_1_1",
        lambda: nvfp4(global_scale=("F32", [1, 1], 0.5)),
        r"global scale shape \[1, 1\]",
        global_name(),
    ),
    (
        "global_nan",
        lambda: nvfp4(global_scale=("F32", [], float("nan"))),
        r"global scale is nan, expected a finite non-zero number",
        global_name(),
    ),
    (
        "global_inf",
        lambda: nvfp4(global_scale=("BF16", [], float("inf"))),
        r"global scale is inf",
        global_name(),
    ),
    (
        "global_neg_inf",
        lambda: nvfp4(global_scale=("F16", [1], float("-inf"))),
        r"global scale is -inf",
        global_name(),
    ),
    ("global_zero", lambda: nvfp4(global_scale=("F32", [], 0.0)), r"global scale is 0.0", global_name()),
    (
        "global_neg_zero",
        lambda: nvfp4(global_scale=("F16", [], -0.0)),
        r"global scale is -0.0",
        global_name(),
    ),
    # The row shards' own checks, as for any table.
    (
        "ceil_layout",
        lambda: nvfp4(rows=(3, 2, 3, 1)),
        r"shard 1 holds 2 rows, expected 3 \(9 rows in 4 parts: ceil\(9/4\) = 3 rows per shard\)",
        shard(1),
    ),
    ("empty_in_middle", lambda: nvfp4(rows=(3, 0, 3, 3)), r"shard 1 holds 0 rows, expected 3", shard(1)),
    (
        "mixed_dtypes",
        lambda: changed(nvfp4(), shard(2), dtype="F8_E4M3", shape=[3, 16]),
        r"dtype F8_E4M3 differs from U8 of shard tensor " + shard(0).replace(".", r"\."),
        shard(2),
    ),
    (
        "mixed_widths",
        lambda: changed(nvfp4(rows=(2, 2)), shard(1), shape=[1, 32]),
        r"row width 32 differs from 16",
        shard(1),
    ),
    ("rows_one_d", lambda: changed(nvfp4(), shard(0), shape=[48]), r"shape \[48\], expected 2-D", shard(0)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed(tmp_path, case):
    _, build, match, tensor = case
    directory = one_file(tmp_path, {**UNRELATED, **build()})
    raises(directory, match, path="model.safetensors", tensor=tensor)


def test_missing_row_shard_index(tmp_path):
    tensors = without(nvfp4(rows=(2, 2, 2, 2)), shard(2), block(2))
    raises(one_file(tmp_path, tensors), r"layer 1: 1 of shard indices 0\.\.3 missing: 2 \(file ")
    # With its block scales left behind, they are reported too.
    tensors = without(nvfp4(rows=(2, 2, 2, 2)), shard(2))
    problems = validate(one_file(tmp_path, tensors))
    assert len(problems) == 2, problems
    assert "missing: 2" in problems[0]
    assert "block scales of shard 2 without its rows" in problems[1] and block(2) in problems[1]


def test_duplicate_block_scales(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", nvfp4(rows=(2, 2)))
    write_safetensors(tmp_path / "b.safetensors", {block(1, prefix=""): nvfp4(rows=(2, 2))[block(1)]})
    raises(
        str(tmp_path),
        r"duplicate block scales of shard index 1: also tensor .* in .*a\.safetensors",
        path="b.safetensors",
        tensor=block(1, prefix=""),
    )


def test_duplicate_global_scale(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", nvfp4())
    write_safetensors(tmp_path / "b.safetensors", {global_name(prefix=""): ("F32", [], scalar("F32", 2.0))})
    raises(str(tmp_path), r"duplicate global scale", path="b.safetensors", tensor=global_name(prefix=""))


def test_truncated_block_scales(tmp_path):
    path = tmp_path / "model.safetensors"
    order = [global_name(), *(shard(i) for i in range(4)), *(block(i) for i in range(4))]
    one_file(tmp_path, nvfp4(rows=(3, 3, 3, 1)), order=order)
    path.write_bytes(path.read_bytes()[:-1])
    raises(
        str(tmp_path),
        r"the file ends 1 bytes before the last tensor does",
        path="model.safetensors",
        tensor=block(3),
    )


def test_block_scale_size_that_does_not_match_its_shape(tmp_path):
    tensors = nvfp4(rows=(2, 2))
    blob = encode_safetensors(tensors)
    length = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + length])
    header[block(1)]["shape"] = [2, 3]
    write_raw(tmp_path / "model.safetensors", header, blob[8 + length :])
    raises(
        str(tmp_path),
        r"invalid shape, data type, or offset for tensor; its entry: .*'shape': \[2, 3\]",
        tensor=block(1),
    )


def test_validate_lists_every_problem(tmp_path):
    tensors = nvfp4(rows=(3, 3, 2, 1), global_scale=("F32", [], float("nan")))
    tensors[scale_name()] = ("F32", [], scalar("F32", 0.5))
    without(tensors, block(1))
    changed(tensors, block(2), shape=[3, 4], data=b"\0" * 12)  # 3 rows for 2, and 4 wide for 2
    tensors[block(5)] = ("F8_E4M3", [0, 2], b"")
    changed(tensors, block(0), dtype="F8_E5M2")
    write_safetensors(tmp_path / "a.safetensors", tensors)
    problems = validate(str(tmp_path))
    expected = [
        ("shard 2 holds 2 rows, expected 3", shard(2)),
        ("shard 3 holds 1 rows, expected 0", shard(3)),
        ("unsharded weight_scale next to an NVFP4 table", scale_name()),
        ("block-scale dtype F8_E5M2", block(0)),
        ("NVFP4 shard 1 without its block scales", block(1)),
        (f"block scales of shard 2 have 3 rows, its row shard {shard(2)} has 2", block(2)),
        ("block-scale width 4, expected 2", block(2)),
        ("block scales of shard 5 without its rows", block(5)),
        ("global scale is nan", global_name()),
    ]
    assert len(problems) == len(expected), problems
    for problem, (text, tensor) in zip(problems, expected, strict=True):
        assert text in problem and f"tensor {tensor})" in problem, (problem, text)
        assert str(tmp_path / "a.safetensors") in problem
    with pytest.raises(CheckpointError) as info:
        read_layout(str(tmp_path))
    assert str(info.value) == problems[0]


def test_validate_goes_on_to_the_block_scales_when_the_rows_are_unsound(tmp_path):
    tensors = changed(nvfp4(rows=(2, 2, 2)), shard(1), dtype="F16", shape=[2, 8])
    without(tensors, block(2), global_name())
    problems = validate(one_file(tmp_path, tensors))
    assert len(problems) == 3, problems
    assert "dtype F16 differs from U8" in problems[0]
    assert "NVFP4 shard 2 without its block scales" in problems[1]
    assert "without its global scale weight_scale_2" in problems[2]
