"""ple_um.checkpoint.scan: the directory (missing, not a directory) and the index file: which files
it makes the scan open, and every way an index or its entries can be refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers.hand_checkpoints import (
    INDEX,
    UNRELATED,
    block,
    global_name,
    indexed,
    nvfp4,
    ple,
    raises,
    scale_name,
    shard,
)
from helpers.reference import (
    reference_rows,
    write_safetensors,
)

import ple_um
from ple_um.checkpoint import find_layers, read_layout, validate
from ple_um.errors import CheckpointError


def test_directory_problems(tmp_path):
    missing = str(tmp_path / "nope")
    raises(missing, r"checkpoint directory .*nope does not exist")
    with pytest.raises(CheckpointError, match="does not exist"):
        find_layers(missing)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    raises(str(a_file), r"is not a directory")
    # A link that leads nowhere is named as one, not as a directory that does not exist.
    os.symlink("nope", tmp_path / "dangling")
    os.symlink("loop", tmp_path / "loop")
    for link in ("dangling", "loop"):
        raises(str(tmp_path / link), rf"checkpoint directory .*{link} is a symbolic link that leads nowhere")


def test_index_picks_the_files(tmp_path):
    tensors = ple(rows=(3, 3, 3, 0))
    files = {
        "model-00001-of-00003.safetensors": {k: tensors[k] for k in (shard(0), shard(1))},
        "model-00002-of-00003.safetensors": {k: tensors[k] for k in (shard(2), shard(3), scale_name())},
        "model-00003-of-00003.safetensors": UNRELATED,
    }
    directory = indexed(tmp_path, files)
    # Garbage that is not in the index, or holds no PLE tensor, is never opened.
    (tmp_path / "stray.safetensors").write_bytes(b"garbage")
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"garbage too")
    layout = read_layout(directory)
    assert [os.path.basename(s.path) for s in layout.shards] == [
        "model-00001-of-00003.safetensors",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
    ]
    assert validate(directory) == []
    os.unlink(tmp_path / INDEX)
    raises(directory, r"exceeds the 100000000 byte limit", path="model-00003-of-00003.safetensors")


def test_index_with_layer_opens_only_that_layers_files(tmp_path):
    files = {"one.safetensors": ple(layer=1), "two.safetensors": ple(layer=2, rows=(2, 2))}
    directory = indexed(tmp_path, files)
    (tmp_path / "one.safetensors").write_bytes(b"broken")
    assert read_layout(directory, layer=2).num_rows == 4
    raises(directory, r"too short", layer=1, path="one.safetensors")
    raises(directory, r"too short", path="one.safetensors")
    raises(directory, r"no PLE shards of layer 3 .*layers with shards: 1, 2", layer=3)


def test_index_in_subfolder_and_symlinked_files(tmp_path, tmp_path_factory):
    (tmp_path / "sub").mkdir()
    blobs = tmp_path_factory.mktemp("blobs")  # the Hugging Face cache: snapshot files link to blobs
    write_safetensors(blobs / "blob1", ple())
    os.symlink(blobs / "blob1", tmp_path / "sub" / "model.safetensors")
    mapping = {name: "sub/model.safetensors" for name in ple()}
    directory = indexed(tmp_path, {}, weight_map=mapping)
    layout = read_layout(directory)
    assert layout.shards[0].path == str(tmp_path / "sub" / "model.safetensors")


@pytest.mark.parametrize(
    "target, match",
    [
        ("/etc/passwd", r"outside the checkpoint directory"),
        ("../model.safetensors", r"outside the checkpoint directory"),
        ("a/../../model.safetensors", r"outside the checkpoint directory"),
        ("..", r"outside the checkpoint directory"),
        ("missing.safetensors", r"'missing.safetensors', a missing file"),
        ("dangling.safetensors", r"'dangling.safetensors', a symlink to a missing file"),
        ("", r"expected a file name"),
        ("a\0b", r"expected a file name"),
        (7, r"names file 7, expected a file name"),
        (None, r"names file None"),
    ],
)
def test_index_entry_problems(tmp_path, target, match):
    tensors = ple()
    os.symlink(tmp_path / "nothing", tmp_path / "dangling.safetensors")
    mapping = {name: "model.safetensors" for name in tensors}
    mapping[shard(1)] = target
    write_safetensors(tmp_path / "model.safetensors", tensors)
    directory = indexed(tmp_path, {}, weight_map=mapping)
    raises(directory, match, path=INDEX, tensor=shard(1))


@pytest.mark.parametrize("how", ["missing", "dangling"])
@pytest.mark.parametrize(
    ("table", "gone"),
    [
        ("fp8", "shard_0"),  # the first shard
        ("fp8", "shard_1"),
        ("fp8", "shard_3"),  # the last shard
        ("fp8", "scale"),
        ("nvfp4", "shard_0"),
        ("nvfp4", "shard_3"),
        ("nvfp4", "block_0"),
        ("nvfp4", "block_3"),
        ("nvfp4", "global"),
    ],
)
def test_an_index_naming_a_missing_file_for_any_table_tensor_is_refused(tmp_path, table, gone, how):
    """Each table tensor in a file of its own, named by the index; the file of one (the first, a
    middle or the last shard's rows, the FP8 scale, an NVFP4 block scale or global scale) missing, or
    a symlink to nothing: read_layout, validate and an open refuse the checkpoint with the same
    CheckpointError, naming the index, the file and the tensor."""
    tensors = nvfp4(rows=(3, 3, 3, 1)) if table == "nvfp4" else ple(rows=(3, 3, 3, 1))
    names = {"scale": scale_name(), "global": global_name()}
    names.update({f"shard_{i}": shard(i) for i in range(4)} | {f"block_{i}": block(i) for i in range(4)})
    files = {f"t{k}.safetensors": {name: t} for k, (name, t) in enumerate(tensors.items())}
    directory = indexed(tmp_path, files)
    (lost,) = [f for f, held in files.items() if names[gone] in held]
    os.unlink(tmp_path / lost)
    if how == "dangling":
        os.symlink(tmp_path / "nothing", tmp_path / lost)
    what = "a symlink to a missing file" if how == "dangling" else "a missing file"
    error = raises(directory, rf"index entry names '{lost}', {what}", path=INDEX, tensor=names[gone])
    with pytest.raises(CheckpointError) as opened:
        ple_um.open_table(directory, mode="cpu", device="cpu")
    assert str(opened.value) == str(error)


def test_index_entry_outside_is_an_error_even_for_other_tensors(tmp_path):
    directory = indexed(
        tmp_path, {"model.safetensors": ple()}, extra={"lm_head.weight": "/abs/x.safetensors"}
    )
    raises(directory, r"outside the checkpoint directory", path=INDEX, tensor="lm_head.weight")


@pytest.mark.parametrize(
    "content, match",
    [
        (b"{not json", r"index is not valid JSON"),
        (b"\xff\xfe", r"index is not valid UTF-8"),
        (b"[]", r"index has no weight_map object"),
        (b'{"metadata": {}}', r"index has no weight_map object"),
        (b'{"weight_map": []}', r"index has no weight_map object"),
        (b"[" * 100_000, r"index JSON is nested too deeply"),
    ],
)
def test_bad_index_file(tmp_path, content, match):
    write_safetensors(tmp_path / "model.safetensors", ple())
    (tmp_path / INDEX).write_bytes(content)
    raises(str(tmp_path), match, path=INDEX)


def test_index_that_is_a_dangling_symlink(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", ple())
    os.symlink(tmp_path / "nothing.json", tmp_path / INDEX)
    raises(str(tmp_path), r"cannot open: No such file or directory", path=INDEX)


def test_index_claims_a_tensor_its_file_lacks(tmp_path):
    tensors = ple(rows=(2, 2))
    write_safetensors(
        tmp_path / "a.safetensors", {shard(0): tensors[shard(0)], scale_name(): tensors[scale_name()]}
    )
    write_safetensors(tmp_path / "b.safetensors", {shard(1): tensors[shard(1)]})
    mapping = {shard(0): "a.safetensors", shard(1): "a.safetensors", scale_name(): "a.safetensors"}
    directory = indexed(tmp_path, {}, weight_map=mapping)
    raises(
        directory,
        r"maps this tensor to a\.safetensors, which does not hold it",
        path="a.safetensors",
        tensor=shard(1),
    )


def test_index_without_ple_entries(tmp_path):
    directory = indexed(tmp_path, {"model.safetensors": UNRELATED})
    raises(directory, r"no PLE shards were found in ")


@pytest.mark.parametrize(
    "held",
    [
        ["scale"],  # the FP8 global scale
        ["shard_3", "scale"],  # the last shard too
        ["shard_0"],
        ["shard_0", "shard_1", "shard_2", "shard_3", "scale"],  # every PLE tensor
        ["nvfp4_global"],
        ["nvfp4_shard_1"],  # rows and block scales of one shard
    ],
)
def test_a_refused_file_without_index_hides_what_it_may_hold(tmp_path, held):
    """No index says what a refused file holds: its problem is the only one listed, none of the
    tensors it may hold is reported missing (here it does hold them, the rest is sound)."""
    tensors = nvfp4() if held[0].startswith("nvfp4") else ple()
    names = {
        "scale": scale_name(),
        "nvfp4_global": global_name(),
        "nvfp4_shard_1": [shard(1), block(1)],
        **{f"shard_{i}": shard(i) for i in range(4)},
    }
    moved = [n for h in held for n in ([names[h]] if isinstance(names[h], str) else names[h])]
    write_safetensors(tmp_path / "a.safetensors", {n: t for n, t in tensors.items() if n not in moved})
    write_safetensors(tmp_path / "b.safetensors", {n: tensors[n] for n in moved})
    (tmp_path / "b.safetensors").write_bytes((tmp_path / "b.safetensors").read_bytes()[:-1])
    for layer in (None, 1):
        (problem,) = validate(str(tmp_path), layer)
        assert "b.safetensors" in problem and "file truncated or offsets wrong" in problem, problem


@pytest.mark.parametrize("indexed_files", [True, False])
def test_one_file_under_two_names_is_read_once(tmp_path, indexed_files):
    """An index naming one file under two names (a symlink beside its target): the file's tensors
    are read once, from the first name, not refused as their own duplicates; so too without an
    index, where both names match *.safetensors. A hard link is the same file too."""
    tensors = ple(rows=(3, 3, 3, 0))
    if indexed_files:
        mapping = {name: ("a.safetensors" if i % 2 else "b.safetensors") for i, name in enumerate(tensors)}
        directory = indexed(tmp_path, {}, weight_map=mapping)
    else:
        directory = str(tmp_path)
    write_safetensors(tmp_path / "a.safetensors", tensors)
    os.symlink("a.safetensors", tmp_path / "b.safetensors")
    os.link(tmp_path / "a.safetensors", tmp_path / "c.safetensors")
    layout = read_layout(directory)
    assert {s.path for s in layout.shards} == {str(tmp_path / "a.safetensors")}
    assert layout.num_rows == 9 and validate(directory) == []
    with ple_um.open_table(directory, mode="cpu", device="cpu") as table:
        got = table.lookup(torch.arange(-1, 10))
        want = reference_rows(layout, np.arange(-1, 10))
        assert np.array_equal(got.view(torch.uint8).numpy().reshape(want.shape), want)
