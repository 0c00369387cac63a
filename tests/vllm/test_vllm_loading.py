"""Loading (``ple_um.vllm.loading``): shard tensors handed over by the real ``load_weights``, never
read when they are views of the table's files and compared with the mapped bytes when they come
from memory; checkpoints that do not fit the layer fail with errors that say what is wrong, naming
the file and tensor, and none is served.
"""

from __future__ import annotations

import glob
import os
import struct

import pytest
import torch
import vllm_harness as h
from safetensors import safe_open
from torch.utils._pytree import tree_map

import ple_um
from ple_um import synthetic

pytestmark = [pytest.mark.vllm, h.needs_vllm]


class _Touch(torch.Tensor):
    """A tensor from the loader that records every aten op run on it or on a view of it."""

    @staticmethod
    def __new__(cls, inner, name, log):
        tensor = torch.Tensor._make_subclass(cls, inner)
        tensor._inner, tensor._name, tensor._log = inner, name, log
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        touched = []

        def unwrap(x):
            if isinstance(x, _Touch):
                x._log.append((x._name, str(func)))
                touched.append(x)
                return x._inner
            return x

        result = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

        def rewrap(r):  # views stay recorded (narrow, then copy_)
            if isinstance(r, torch.Tensor) and not isinstance(r, _Touch):
                for source in touched:
                    if r.untyped_storage().data_ptr() == source._inner.untyped_storage().data_ptr():
                        return _Touch(r, source._name, source._log)
            return r

        return tree_map(rewrap, result)


def _recording(directory, log):
    for name, tensor in h.checkpoint_weights(directory):
        yield name, _Touch(tensor, name, log)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_loading_reads_no_shard(world, patched, table_dir, tmp_path, dtype):
    """With the plugin on, load_weights never runs an op on a shard tensor (no byte is read: for
    NVFP4 neither the packed rows nor the block scales); the global scale loads as stock. The same
    recording shows the stock backend copying every shard tensor."""
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    scale = f"ngram_embedding.{h.GLOBAL_SCALE[dtype]}"
    sharded = {"ngram_embedding.weight"} | ({"ngram_embedding.weight_scale"} if dtype == "nvfp4" else set())

    log: list[tuple[str, str]] = []
    mapped = h.build(config, ple_um_on=True)
    loaded = mapped.load_weights(_recording(layout.directory, log))
    assert sharded | {scale} <= loaded
    assert not [entry for entry in log if ".shard_" in entry[0]]
    assert any(name == scale for name, _ in log)
    assert mapped.ngram_embedding.shards_skipped == h.PARTS * h.PER_SHARD[dtype]
    assert mapped.ngram_embedding.shards_compared == 0

    log.clear()
    stock = h.build(config, ple_um_on=False)
    assert stock.load_weights(_recording(layout.directory, log)) >= sharded | {scale}
    copied = {name for name, op in log if ".shard_" in name and op.startswith("aten.copy_")}
    assert len(copied) == h.PARTS * h.PER_SHARD[dtype]
    mapped.ngram_embedding.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_reload_from_memory_is_compared(world, patched, table_dir, tmp_path, dtype):
    """Shard tensors delivered in memory are compared with the mapped files (NVFP4: the packed rows
    through lookup_packed's bytes, and the block scales through its scales)."""
    from ple_um.vllm.backend import ReloadMismatchError

    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    module = h.mapped(config, layout.directory)
    backend = module.ngram_embedding

    in_memory = [(name, tensor.clone()) for name, tensor in h.checkpoint_weights(layout.directory)]
    module.load_weights(iter(in_memory))  # the same rows: accepted
    assert backend.shards_compared == h.PARTS * h.PER_SHARD[dtype]

    cases = [("shard_3.weight", "shard 3 "), ("shard_3.weight_scale", "shard 3 block scales")]
    for changed_name, what in cases[: h.PER_SHARD[dtype]]:
        changed = []
        for name, tensor in in_memory:
            if name == f"ngram_embedding.{changed_name}":
                tensor = tensor.clone()
                tensor.view(torch.uint8)[17, 1] ^= 1
            changed.append((name, tensor))
        with pytest.raises(ReloadMismatchError) as info:
            module.load_weights(iter(changed))
        message = str(info.value)
        assert what in message and "row 566" in message, message  # 3 * 183 + 17
        assert changed_name in message  # the tensor named
    backend.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_rows_synced_in_another_dtype_are_compared_after_stock_cast(
    world, patched, table_dir, tmp_path, dtype
):
    """A weight sync delivering FP8 or BF16 shard rows as float32: stock vLLM casts them to the
    table's dtype as it copies them, and so does the comparison. float32 rows that cast to the
    stored ones (exactly those, or nudged by less than half a step) are accepted, and the layer
    returns what stock returns after loading the same tensors; a row that casts to another value
    is refused, naming it."""
    from ple_um.delivered import ReloadMismatchError

    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    module = h.mapped(config, layout.directory)
    backend = module.ngram_embedding
    stock = h.stock(config, layout.directory)

    def as_float32(nudge: float = 0.0):
        return [
            (name, t.float() * (1 + nudge) if ".shard_" in name else t)
            for name, t in h.delivered(layout.directory, "memory")
        ]

    for nudge in (0.0, 2.0**-12):
        synced = as_float32(nudge)
        assert any(t.dtype == torch.float32 for _, t in synced)
        module.load_weights(iter(synced))
        stock.load_weights(iter(synced))
        for seed in (0, 1):
            assert h.same_bits(h.forward(module, seed)[0], h.forward(stock, seed)[0])
    assert backend.shards_compared == 2 * h.PARTS

    changed = as_float32()
    name, rows = next((n, t) for n, t in changed if n.endswith("shard_3.weight"))
    rows[17] = rows[17] * 4 + 1  # casts to other values
    with pytest.raises(ReloadMismatchError, match=r"shard 3 at row 566 "):  # 3 * 183 + 17
        module.load_weights(iter(changed))
    backend.close_table()


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("table_elsewhere", [False, True], ids=["loaded", "PLE_UM_DIR"])
def test_wrong_row_width(world, patched, table_dir, tmp_path, table_elsewhere, dtype):
    """Rows of half the layer's head_dim (FP8: 4 of 8; NVFP4: 16 of 32 values): rejected when vLLM
    delivers the shards (shape check, as stock does) and when PLE_UM_DIR names the table (layout
    check), by a CheckpointError naming the file and the tensor."""
    config = h.text_config(dtype=dtype)
    right = h.write_table(tmp_path / "right", config)
    wrong = h.write_table(tmp_path / "wrong", config, row_dim=h.head_dim(config) // 2)
    table_dir(wrong.directory)
    module = h.build(config, ple_um_on=True)
    source = right.directory if table_elsewhere else wrong.directory
    with pytest.raises(ple_um.CheckpointError, match="row width|head_dim") as info:
        h.load(module, source)
    _names_a_file_and_shard(info.value, wrong)
    assert module.ngram_embedding.table is None


def _names_a_file_and_shard(error: ple_um.CheckpointError, layout) -> None:
    """The error names one of ``layout``'s files and a shard tensor."""
    assert error.path is not None and os.path.realpath(error.path) in {
        os.path.realpath(spec.path) for spec in (*layout.shards, *layout.block_scales)
    }, str(error)
    assert error.tensor is not None and "shard_" in error.tensor, str(error)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("table_elsewhere", [False, True], ids=["loaded", "PLE_UM_DIR"])
def test_wrong_row_count(world, patched, table_dir, tmp_path, table_elsewhere, dtype):
    config = h.text_config(dtype=dtype)
    right = h.write_table(tmp_path / "right", config)
    wrong = h.write_table(tmp_path / "wrong", config, num_rows=right.num_rows + 7)
    table_dir(wrong.directory)
    module = h.build(config, ple_um_on=True)
    source = right.directory if table_elsewhere else wrong.directory
    with pytest.raises(ple_um.CheckpointError, match="rows") as info:
        h.load(module, source)
    _names_a_file_and_shard(info.value, wrong)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_wrong_shard_count(world, patched, table_dir, tmp_path, dtype):
    config = h.text_config(dtype=dtype)
    right = h.write_table(tmp_path / "right", config)
    table_dir(h.write_table(tmp_path / "wrong", config, shards=h.PARTS + 1).directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="split_ngram_parts"):
        h.load(module, right.directory)


@pytest.mark.parametrize("kind", ["weight", "weight_scale"])
@pytest.mark.parametrize("open_first", [False, True], ids=["not-open", "open"])
def test_a_wrong_shard_names_the_checkpoints_full_tensor_and_file(
    world, patched, table_dir, tmp_path, kind, open_first
):
    """A shard tensor of the wrong shape delivered in memory (a weight sync): the error names the
    tensor as the checkpoint's index does (its full name, not the layer-relative one vLLM hands the
    layer) and the file that holds it, whether the table is open yet or not."""
    config = h.text_config(dtype="nvfp4")
    layout = h.write_table(table_dir(tmp_path / "model"), config, dtype="nvfp4")
    module = h.build(config, ple_um_on=True)
    if open_first:
        h.load(module, layout.directory)
    shard = 2
    name = f"ngram_embedding.shard_{shard}.{kind}"
    tensor = dict(h.delivered(layout.directory, "memory"))[name]
    with pytest.raises(ple_um.CheckpointError, match="Shape mismatch") as info:
        module.load_weights(iter([(name, tensor[:-1])]))
    spec = (layout.shards if kind == "weight" else layout.block_scales)[shard]
    assert spec.tensor.startswith(synthetic.PREFIX) and spec.tensor.endswith(name)
    assert info.value.tensor == spec.tensor, str(info.value)
    assert os.path.realpath(info.value.path) == os.path.realpath(spec.path), str(info.value)


DTYPE_PAIRS = [(a, b) for a in ("fp8", "bf16", "nvfp4") for b in ("fp8", "bf16", "nvfp4") if a != b]
PAIR_IDS = [f"{a}-layer-{b}-table" for a, b in DTYPE_PAIRS]


@pytest.mark.parametrize(("layer", "table"), DTYPE_PAIRS, ids=PAIR_IDS)
def test_dtype_must_match_quant_method(world, patched, table_dir, tmp_path, layer, table):
    """PLE_UM_DIR naming a table of another dtype than the layer's embedding method serves (FP8,
    BF16, NVFP4; rows of the same width): not vLLM's numerics, refused before anything is mapped."""
    config = h.text_config(dtype=layer, head_dim=h.NVFP4_HEAD_DIM)
    model = h.write_table(tmp_path / "model", config)
    table_dir(h.write_table(tmp_path / "table", config, dtype=table).directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="stored as") as info:
        h.load(module, model.directory)
    if "nvfp4" in (layer, table):
        assert "NVFP4" in str(info.value) and "ple_embedding_dtype='nvfp4'" in str(info.value)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize("layer", ["fp8", "bf16"])
def test_nvfp4_checkpoint_under_another_method(world, patched, table_dir, tmp_path, layer):
    """An NVFP4 checkpoint loaded into a layer configured FP8 (or BF16): its packed shards are
    refused as they arrive, the cure named, before any byte is read or anything mapped."""
    config = h.text_config(dtype=layer, head_dim=h.NVFP4_HEAD_DIM)
    model = h.write_table(table_dir(tmp_path / "model"), config, dtype="nvfp4")
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError) as info:
        h.load(module, model.directory)
    message = str(info.value)
    assert "NVFP4" in message and "ple_embedding_dtype='nvfp4'" in message
    assert "shard_0" in message and os.path.basename(model.shards[0].path) in message  # file named
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize("table", ["fp8", "bf16"])
def test_other_checkpoint_under_nvfp4_method(world, patched, table_dir, tmp_path, table):
    """An FP8 (or BF16) checkpoint loaded into a layer configured NVFP4: refused as stock refuses
    it (a cast would reinterpret the bytes), and saying the table is not NVFP4."""
    config = h.text_config(dtype="nvfp4")
    model = h.write_table(table_dir(tmp_path / "model"), config, dtype=table)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match=r"requires torch\.uint8.*not NVFP4"):
        h.load(module, model.directory)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize(
    ("dtype", "scale_name", "expected"),
    [("fp8", synthetic.scale_name, "scale"), ("nvfp4", synthetic.global_scale_name, "weight_scale_2")],
    ids=["fp8", "nvfp4"],
)
def test_without_global_scale(world, patched, table_dir, tmp_path, dtype, scale_name, expected):
    config = h.text_config(dtype=dtype)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    h.drop_tensor(layout.directory, scale_name(h.LAYER))
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match=expected):
        h.load(module, layout.directory)


def test_nvfp4_without_block_scales_of_a_shard(world, patched, table_dir, tmp_path):
    config = h.text_config(dtype="nvfp4")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config)
    h.drop_tensor(layout.directory, synthetic.block_scale_name(h.LAYER, 2))
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="shard_2.weight_scale|block scale"):
        h.load(module, layout.directory)
    assert module.ngram_embedding.table is None


@pytest.mark.parametrize(("dtype", "name"), [("fp8", "weight_scale"), ("nvfp4", "weight_scale_2")])
def test_scale_of_another_table(world, patched, table_dir, tmp_path, dtype, name):
    """PLE_UM_DIR naming a table whose global scale differs from the one vLLM loaded: refused, and
    the table is not served."""
    config = h.text_config(dtype=dtype)
    model = h.write_table(tmp_path / "model", config, seed=0)
    other = h.write_table(tmp_path / "other", config, seed=9)
    table_dir(other.directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match=f"loaded {name} ") as info:
        h.load(module, model.directory)
    assert module.ngram_embedding.table is None and module.ngram_embedding.served.staged is None
    # The error names the other table's scale tensor and the file that holds it.
    scale = (synthetic.scale_name if dtype == "fp8" else synthetic.global_scale_name)(h.LAYER)
    assert info.value.tensor == scale and info.value.path in other.files
    with safe_open(info.value.path, framework="pt") as f:
        assert scale in f.keys()  # noqa: SIM118


def _shift_header(path: str) -> None:
    """A shifted header: the header length one short, so that the header loses its last pad
    space (padded first when it has none) and stays sound JSON, and every tensor of the file is
    read one byte early."""
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    text, data = blob[8 : 8 + length], blob[8 + length :]
    if not text.endswith(b" "):
        text += b" " * 8
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) - 1) + text + data)


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "nvfp4"])
def test_shifted_header_in_the_table_directory(world, patched, table_dir, tmp_path, dtype):
    """PLE_UM_DIR names a copy of the table whose first file (shard tensors only) has a shifted
    header. vLLM never opens those files; its safetensors loader would refuse this one; the plugin
    refuses it at load, naming the file and a tensor, and maps nothing."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    config = h.text_config(dtype=dtype)
    model = h.write_table(tmp_path / "model", config)
    table = h.write_table(tmp_path / "table", config)
    shifted = table.shards[0].path
    with safe_open(shifted, framework="pt") as f:
        assert all(".shard_" in name for name in f.keys())  # noqa: SIM118 - a file vLLM skips
    _shift_header(shifted)
    with pytest.raises(Exception, match="incomplete metadata"):  # stock vLLM's loader, on that file
        list(safetensors_weights_iterator([shifted], False))
    table_dir(table.directory)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="shifted header") as info:
        h.load(module, model.directory)
    assert info.value.path == shifted and info.value.tensor is not None
    assert module.ngram_embedding.table is None


def test_shifted_header_in_the_models_own_files(world, patched, table_dir, tmp_path):
    """The model's own checkpoint with a shifted shard file, loaded as vLLM's default loader loads
    it with the plugin: its weights are a lazy generator whose file filter opens every header
    (with safetensors, whose error does not name the file). The plugin's model-level hook checks
    the table's headers before that generator starts, so start-up fails naming the file."""
    from vllm.model_executor.model_loader.weight_utils import (
        filter_safetensors_files_by_weight_name,
        safetensors_weights_iterator,
    )
    from vllm.models.qwen4_exp.nvidia import model as qwen4_exp_model

    from ple_um.vllm.patch import _model_load_weights

    config = h.text_config(fp8=True)
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, fp8=True)
    shifted = layout.shards[0].path
    _shift_header(shifted)
    holder = torch.nn.Module()
    holder.add_module("ple", h.build(config, ple_um_on=True))
    unused = qwen4_exp_model.Qwen4ExpForConditionalGeneration.is_unused_checkpoint_weight

    def vllm_weights():  # DefaultModelLoader.get_all_weights, reduced to what touches the files
        files = sorted(glob.glob(os.path.join(layout.directory, "*.safetensors")))
        files = filter_safetensors_files_by_weight_name(files, lambda name: unused(holder, name))
        yield from safetensors_weights_iterator(files, False)

    with pytest.raises(Exception, match="incomplete metadata"):  # what vLLM's loader meets first
        next(vllm_weights())
    load_weights = _model_load_weights(lambda model, weights: {name for name, _ in weights})
    with pytest.raises(ple_um.CheckpointError, match="shifted header") as info:
        load_weights(holder, vllm_weights())
    assert info.value.path == shifted
    assert holder.ple.ngram_embedding.table is None


def test_an_unsharded_table_is_refused_naming_its_file(world, patched, table_dir, tmp_path):
    """A checkpoint that stores the table as one ``ngram_embedding.weight`` tensor, delivered as
    vLLM's iterator delivers it (a view of the file): refused, naming the tensor and its file."""
    from safetensors.torch import save_file

    config = h.text_config(fp8=False)
    table_dir(h.write_table(tmp_path / "table", config, fp8=False).directory)
    path = tmp_path / "unsharded" / "model.safetensors"
    path.parent.mkdir()
    name = f"{synthetic.PREFIX}layers.{h.LAYER}.ple.ple_embedding.ngram_embedding.weight"
    save_file({name: torch.ones(h.table_rows(config), h.HEAD_DIM, dtype=torch.bfloat16)}, str(path))
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="unsharded") as info:
        module.load_weights(h.checkpoint_weights(path.parent))
    assert info.value.tensor == name  # the checkpoint's full name, as its file holds it
    assert info.value.path == os.path.realpath(path)


@pytest.mark.parametrize(
    ("table", "model"),
    [("bf16", torch.float16), ("f16", torch.bfloat16), ("bf16", torch.float32)],
    ids=["bf16-table-f16-model", "f16-table-bf16-model", "bf16-table-f32-model"],
)
def test_a_16_bit_table_under_another_model_dtype_is_served_as_stock_casts_it(
    world, patched, table_dir, tmp_path, table, model
):
    """A 16-bit table under another model dtype (a BF16 table under ``--dtype float16``): stock's
    unquantized layer holds its table in the model dtype and casts the checkpoint's rows into it.
    The ple-um layer serves the table converted the same way: every row returned equals stock's bit
    for bit; rows a sync delivers in memory, in the table's dtype or in the model's (stock's own
    cast rows), are accepted, and a changed row is refused naming it."""
    from ple_um.delivered import ReloadMismatchError

    config = h.text_config(dtype="bf16")
    layout = h.write_table(table_dir(tmp_path / "ckpt"), config, dtype=table, seed=31)
    assert layout.scale is None and layout.dtype != model
    stock = h.stock(config, layout.directory, params_dtype=model)
    module = h.mapped(config, layout.directory, params_dtype=model)
    ours, theirs = module.ngram_embedding, stock.ngram_embedding
    assert ours.weight.dtype == theirs.weight.dtype == ours.lookup_dtype == model
    ids = torch.arange(layout.num_rows).view(-1, h.HEADS)  # every row of every shard
    with torch.no_grad():
        got = ours(ids)
        assert got.dtype == model and got.view(torch.uint8).any()
        assert h.same_bits(got, theirs(ids))
        assert h.same_bits(got, h.file_rows(layout, ids).to(model))
    for seed in (0, 1):
        raw, dequantized = h.forward(module, seed, model)
        expected_raw, expected = h.forward(stock, seed, model)
        assert h.same_bits(raw, expected_raw) and h.same_bits(dequantized, expected)

    as_stored = h.delivered(layout.directory, "memory")
    as_cast = [(n, t.to(model) if ".shard_" in n else t) for n, t in as_stored]
    for weights in (as_stored, as_cast):
        module.load_weights(iter(weights))
    assert ours.shards_compared == 2 * h.PARTS
    name, rows = next((n, t) for n, t in as_cast if n.endswith("shard_2.weight"))
    rows[5] = rows[5] * 2 + 1
    with pytest.raises(ReloadMismatchError, match=r"shard 2 at row 371 ") as info:  # 2 * 183 + 5
        module.load_weights(iter(as_cast))
    assert layout.shards[2].path in str(info.value) and layout.shards[2].tensor in str(info.value)
    ours.close_table()
