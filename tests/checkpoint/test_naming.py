"""ple_um.checkpoint.naming: PLE tensors under any prefix, look-alike names left alone, and the
names of the scales expected beside a shard."""

from __future__ import annotations

import pytest
from helpers.hand_checkpoints import block, global_name, one_file, ple, scale_name, shard

from ple_um.checkpoint import read_layout
from ple_um.checkpoint.naming import block_scale_name, global_scale_name, ple_match, rows_name
from ple_um.checkpoint.naming import scale_name as expected_scale


@pytest.mark.parametrize("prefix", ["", "model.", "a.b.c.", "model.language_model."])
def test_any_prefix(tmp_path, prefix):
    layout = read_layout(one_file(tmp_path, ple(prefix=prefix)))
    assert layout.shards[0].tensor == shard(0, prefix=prefix)
    assert layout.scale_tensor == scale_name(prefix=prefix)


def test_similar_names_are_not_ple(tmp_path):
    lookalikes = {
        "model.xlayers.1.ple.ple_embedding.ngram_embedding.shard_0.weight": ("U8", [1, 4], b"\1" * 4),
        shard(0) + ".bias": ("U8", [1, 4], b"\1" * 4),
        shard(0).replace("shard_0", "shard_x"): ("U8", [1, 4], b"\1" * 4),
        "layers.1.ple.ple_embedding.ngram_embedding.shard_٣.weight": ("U8", [1, 4], b"\1" * 4),
    }
    layout = read_layout(one_file(tmp_path, {**lookalikes, **ple()}))
    assert layout.parts == 4


@pytest.mark.parametrize(
    "name, match",
    [
        (shard(3, layer=12), (12, "shard", 3)),
        (shard(0, prefix=""), (1, "shard", 0)),
        (block(7, layer=2), (2, "block_scale", 7)),
        (scale_name(layer=5), (5, "scale", None)),
        (global_name(prefix="x."), (1, "global_scale", None)),
        (shard(1).replace("shard_1", "shard_007"), (1, "shard", 7)),  # a leading zero: the same index
        (shard(123_456_789), (1, "shard", 123_456_789)),
        (shard(1_234_567_890), None),  # ten digits: no real table has them
        (shard(int("9" * 4000)), None),
        ("model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight.extra", None),
        ("model.xlayers.1.ple.ple_embedding.ngram_embedding.shard_1.weight", None),
        ("model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale_3", None),
        ("model.embed_tokens.weight", None),
    ],
)
def test_ple_match(name, match):
    assert ple_match(name) == match


def test_expected_names_beside_a_shard():
    for prefix in ("", "model.language_model."):
        rows = shard(4, layer=9, prefix=prefix)
        assert expected_scale(rows) == scale_name(layer=9, prefix=prefix)
        assert global_scale_name(rows) == global_name(layer=9, prefix=prefix)
        assert block_scale_name(rows) == block(4, layer=9, prefix=prefix)
        assert rows_name(block(4, layer=9, prefix=prefix)) == rows
