"""ple_um.checkpoint.validation: every way the shards and the scale of an FP8 or 16-bit table can
be refused, and validate listing every problem where read_layout raises the first."""

from __future__ import annotations

import pytest
from helpers.hand_checkpoints import (
    UNRELATED,
    changed,
    entry,
    one_file,
    ple,
    raises,
    scalar,
    scale_name,
    shard,
)
from helpers.reference import write_raw, write_safetensors

from ple_um.checkpoint import read_layout, validate
from ple_um.errors import CheckpointError

SHARD_CASES = [
    (
        "mixed_dtypes",
        lambda: changed(ple(dim=4), shard(2), "F16", [3, 2]),
        r"dtype F16 differs from F8_E4M3 of shard tensor " + shard(0).replace(".", r"\."),
        shard(2),
    ),
    (
        "mixed_widths",
        lambda: changed(ple(rows=(2, 2, 2)), shard(1), shape=[1, 8]),
        r"row width 8 differs from 4",
        shard(1),
    ),
    ("one_d", lambda: changed(ple(), shard(1), shape=[12]), r"shape \[12\], expected 2-D", shard(1)),
    (
        "three_d",
        lambda: changed(ple(), shard(0), shape=[3, 2, 2]),
        r"shape \[3, 2, 2\], expected 2-D",
        shard(0),
    ),
    (
        "unsupported_dtype",
        lambda: ple(dtype="F32", scale=None),
        r"unsupported dtype F32 for a PLE shard \(supported: F8_E4M3, F8_E5M2, BF16, F16, U8 \(NVFP4\)\)",
        shard(0),
    ),
    (
        "wrong_rows",
        lambda: ple(rows=(3, 2, 3, 1)),
        r"shard 1 holds 2 rows, expected 3 \(9 rows in 4 parts",
        shard(1),
    ),
    ("empty_in_middle", lambda: ple(rows=(3, 0, 3, 3)), r"shard 1 holds 0 rows, expected 3", shard(1)),
    ("too_many_rows_last", lambda: ple(rows=(2, 2, 3)), r"shard 0 holds 2 rows, expected 3", shard(0)),
    ("zero_rows", lambda: ple(rows=(0, 0)), r"layer 1: the table has 0 rows", shard(0)),
    ("zero_width", lambda: ple(rows=(3, 3), dim=0), r"rows have 0 elements", shard(0)),
    (
        "fp8_without_scale",
        lambda: ple(scale=None),
        r"FP8 table \(F8_E4M3\) without its global scale",
        scale_name(),
    ),
    (
        "e5m2_without_scale",
        lambda: ple(dtype="F8_E5M2", scale=None),
        r"without its global scale",
        scale_name(),
    ),
    (
        "scale_f64",
        lambda: ple(scale=("F64", [], 0.5)),
        r"scale dtype F64 is not one of F32, BF16, F16",
        scale_name(),
    ),
    (
        "scale_shape_2",
        lambda: ple(scale=("F32", [2], 0.5)) | {scale_name(): ("F32", [2], b"\0" * 8)},
        r"scale shape \[2\]",
        scale_name(),
    ),
    (
        "scale_shape_1_1",
        lambda: ple(scale=("F32", [1, 1], 0.5)),
        r"scale shape \[1, 1\] is not \[\] or \[1\]",
        scale_name(),
    ),
    (
        "scale_nan",
        lambda: ple(scale=("F32", [], float("nan"))),
        r"scale is nan, expected a finite non-zero",
        scale_name(),
    ),
    ("scale_inf", lambda: ple(scale=("BF16", [], float("inf"))), r"scale is inf", scale_name()),
    ("scale_neg_inf", lambda: ple(scale=("F16", [1], float("-inf"))), r"scale is -inf", scale_name()),
    ("scale_zero", lambda: ple(scale=("F32", [], 0.0)), r"scale is 0.0", scale_name()),
    ("scale_neg_zero", lambda: ple(scale=("F16", [], -0.0)), r"scale is -0.0", scale_name()),
]


@pytest.mark.parametrize("case", SHARD_CASES, ids=[c[0] for c in SHARD_CASES])
def test_bad_shards_and_scales(tmp_path, case):
    _, build, match, tensor = case
    directory = one_file(tmp_path, {**UNRELATED, **build()})
    raises(directory, match, path="model.safetensors", tensor=tensor)


def test_missing_shard_indices(tmp_path):
    tensors = ple(rows=(2, 2, 2, 2, 2, 2))
    del tensors[shard(2)], tensors[shard(4)]
    error = raises(one_file(tmp_path, tensors), r"layer 1: 2 of shard indices 0\.\.5 missing: 2, 4 \(file ")
    assert error.path is not None


def test_missing_shard_indices_of_a_huge_index_are_listed_briefly(tmp_path):
    tensors = ple(rows=(2,)) | {shard(999_999_999): ("F8_E4M3", [0, 4], b"")}
    error = raises(
        one_file(tmp_path, tensors), r"999999998 of shard indices 0..999999999 missing: 1, 2, .*, 10, \.\.\."
    )
    assert len(str(error)) < 400


def test_duplicate_shard_index(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", ple(rows=(2, 2)))
    write_safetensors(tmp_path / "b.safetensors", {shard(1): ple(rows=(2, 2))[shard(1)]})
    raises(
        str(tmp_path),
        r"duplicate shard index 1: also tensor .* in .*a\.safetensors",
        path="b.safetensors",
        tensor=shard(1),
    )


def test_duplicate_shard_index_by_spelling(tmp_path):
    tensors = ple(rows=(2, 2)) | {shard(1).replace("shard_1", "shard_01"): ple(rows=(2, 2))[shard(1)]}
    raises(one_file(tmp_path, tensors), r"duplicate shard index 1", tensor=shard(1))


def test_duplicate_scale(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", ple())
    write_safetensors(tmp_path / "b.safetensors", {scale_name(prefix=""): ("F32", [], scalar("F32", 2.0))})
    raises(str(tmp_path), r"duplicate scale", path="b.safetensors", tensor=scale_name(prefix=""))


def test_validate_lists_every_problem(tmp_path):
    tensors = changed(ple(rows=(3, 3, 3, 0)), shard(1), shape=[3, 2], data=b"\0" * 6)
    tensors[scale_name()] = ("F32", [], scalar("F32", float("nan")))
    write_safetensors(tmp_path / "a.safetensors", tensors)
    header = {"x": entry(shape=(3,)), "y": entry(dtype=1, offsets=(8, 16))}
    write_raw(tmp_path / "b.safetensors", header, b"\0" * 16)
    problems = validate(str(tmp_path))
    # A broken file counts once, with the package's refusal: its JSON (y's dtype) before sizes (x's).
    assert len(problems) == 2, problems
    assert "b.safetensors" in problems[0] and "tensor y" in problems[0]
    assert "invalid type: integer `1`" in problems[0]
    assert "row width 2 differs" in problems[1]
    with pytest.raises(CheckpointError) as info:
        read_layout(str(tmp_path))
    assert str(info.value) == problems[0]
