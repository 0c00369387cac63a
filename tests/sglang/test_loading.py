"""SGLang's loader under the plugin: the table's tensors are never read, the rest loads as stock,
bad checkpoints get ple-um's errors naming the file and the tensor, and a table delivered in memory
is compared with the files."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ple_um.errors import CheckpointError
from ple_um.residency import evict_pages


@pytest.fixture
def watched_tensors(monkeypatch):
    """The names every ``safetensors.safe_open(...).get_tensor`` was asked for during the test (SGLang's
    weight iterators and the plugin's reader open files only through it)."""
    import safetensors

    asked: list[str] = []
    opened = safetensors.safe_open

    class Watched:
        def __init__(self, *args, **kwargs):
            self._file = opened(*args, **kwargs)

        def __enter__(self):
            self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._file.keys()

        def get_tensor(self, name):
            asked.append(name)
            return self._file.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self._file, name)

    monkeypatch.setattr(safetensors, "safe_open", Watched)
    return asked


@pytest.mark.parametrize("extra", [{}, {"enable_multithread_load": False}], ids=["multithread", "single"])
@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_no_table_tensor_is_read(extra, dtype, sglang_checkpoint, load_model, tiny, watched_tensors, rng):
    """Neither SGLang's iterator nor the plugin asks safetensors for a table tensor, while every other
    tensor, in a file of its own or beside shards, is loaded as stock loads it."""
    from ple_um.sglang.source import table_tensor

    directory, layout, key_proj = sglang_checkpoint(dtype, seed=int(rng.integers(1 << 30)), files=3)
    key_name = f"model.language_model.layers.{tiny.layer}.ple.key_proj.weight"
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))["weight_map"]
    key_file = os.path.join(directory, index[key_name])
    assert any(s.path == key_file for s in layout.shards)  # a file that mixes shards with key_proj
    assert any(s.path != key_file for s in layout.shards)  # and files of shards only
    model = load_model(directory, ple_um=True, **extra)
    assert watched_tensors, "no tensor was read through safetensors.safe_open: the watch no longer applies"
    assert [n for n in watched_tensors if table_tensor(n) is not None] == []
    assert key_name in watched_tensors
    assert torch.equal(model.model.layers[tiny.layer].ple.key_proj.weight.data, key_proj)
    if dtype == "fp8":
        assert layout.scale_tensor in watched_tensors  # the global FP8 scale loads as stock
    if dtype == "fp8":  # the stock model asks for every shard: the watch sees what the plugin avoids
        watched_tensors.clear()
        load_model(directory, ple_um=False, **extra)
        assert {s.tensor for s in layout.shards} <= set(watched_tensors)


def test_shard_only_files_stay_out_of_the_page_cache(sglang_checkpoint, load_model, tiny, rng):
    """The loader's whole weight stream, every tensor touched, leaves the files that hold only shards
    out of the page cache, but for the pages of their headers (and the kernel's readahead after
    them), which ple-um reads to check the table; the stock stream reads them whole."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    from ple_um.operating import residency

    # 4 MiB shards of 16-byte rows: large beside a header's pages.
    directory, layout, _ = sglang_checkpoint(
        "bf16", seed=int(rng.integers(1 << 30)), files=3, ngram_vocab_size_base=1 << 18
    )
    only_shards = {os.path.basename(s.path) for s in layout.shards} - {
        os.path.basename(layout.shards[-1].path)
    }
    model = load_model(directory, ple_um=True)  # a model to iterate for
    model.model.layers[tiny.layer].ple.ple_embedding.ngram_embedding.close_table()

    def drop() -> None:
        evict_pages(os.path.join(directory, name) for name in only_shards)

    def resident() -> tuple[int, int]:
        files = [f for f in residency(directory, tiny.layer)["files"] if f["file"] in only_shards]
        return sum(f["resident_bytes"] for f in files), sum(f["mapped_bytes"] for f in files)

    def stream(ple_um: bool) -> int:
        drop()
        before, size = resident()  # the measure reads the headers (and what the kernel reads ahead)
        if before > size // 4:
            pytest.skip("this filesystem keeps the files' pages after POSIX_FADV_DONTNEED (tmpfs?)")
        if ple_um:
            os.environ["PLE_UM"] = "1"
        try:
            model_config = ModelConfig(directory, language_model_only=True)
            loader = get_model_loader(load_config=LoadConfig(), model_config=model_config)
            for _, tensor in loader._get_all_weights(model_config, model):
                float(tensor.float().sum())  # every byte of every tensor yielded is read
        finally:
            os.environ.pop("PLE_UM", None)
        return before

    before = stream(ple_um=True)
    cached, size = resident()
    assert size > 8 << 20 and cached - before <= len(only_shards) * (256 << 10), (before, cached, size)
    stream(ple_um=False)
    cached, size = resident()
    assert cached == size  # the stock stream reads the shards: the measure sees them


def test_broken_shard_file_is_refused_naming_file_and_tensor(sglang_checkpoint, load_model, rng):
    directory, layout, _ = sglang_checkpoint("fp8", seed=int(rng.integers(1 << 30)), files=3)
    victim = layout.shards[0]
    with open(victim.path, "r+b") as f:
        f.truncate(os.path.getsize(victim.path) - 3)
    with pytest.raises(CheckpointError) as caught:
        load_model(directory, ple_um=True)
    message = str(caught.value)
    assert victim.path in message and any(s.tensor in message for s in layout.shards if s.path == victim.path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"split_ngram_parts": 5}, "split into 4 shards, but the config has split_ngram_parts=5"),
        ({"heads_per_ngram": 4}, "rows have 8 elements, but the layer's row width is 4"),
        ({"num_rows": 248}, "the table has 248 rows, but the config gives 240"),
    ],
)
def test_table_that_does_not_fit_the_config_is_refused(change, match, sglang_checkpoint, load_model, rng):
    directory, layout, _ = sglang_checkpoint("fp8", seed=int(rng.integers(1 << 30)), **change)
    with pytest.raises(CheckpointError, match=match) as caught:
        load_model(directory, ple_um=True)
    assert layout.shards[0].path in str(caught.value) and layout.shards[0].tensor in str(caught.value)


def test_table_dir_from_ple_um_dir(sglang_checkpoint, load_model, tiny, monkeypatch, rng):
    """PLE_UM_DIR serves the table from another copy; one that is not a directory, or whose table is
    another checkpoint's (its FP8 scale differs from the one SGLang loaded), is refused."""
    seed = int(rng.integers(1 << 30))
    directory, layout, _ = sglang_checkpoint("fp8", seed=seed)
    copy, _, _ = sglang_checkpoint("fp8", seed=seed)
    monkeypatch.setenv("PLE_UM_DIR", copy)
    table = tiny.ngram(load_model(directory, ple_um=True)).ngram_embedding.table
    assert table.layout.directory == os.path.realpath(copy)
    monkeypatch.setenv("PLE_UM_DIR", os.path.join(copy, "nowhere"))
    with pytest.raises(CheckpointError, match="PLE_UM_DIR=.* is not a directory"):
        load_model(directory, ple_um=True)
    # Another checkpoint's table, its scale apart from this one's even in bf16 (the coarsest dtype
    # an engine may hold it in): two seeds' scales can round to one bf16 value.
    for other_seed in range(seed + 1, seed + 100):
        other, other_layout, _ = sglang_checkpoint("fp8", seed=other_seed)
        if _bf16(other_layout.scale) != _bf16(layout.scale):
            break
    monkeypatch.setenv("PLE_UM_DIR", other)
    with pytest.raises(CheckpointError, match="does not belong to this checkpoint"):
        load_model(directory, ple_um=True)


def _bf16(scale: float) -> float:
    return torch.tensor(scale).to(torch.bfloat16).item()


def test_a_remap_is_refused_while_graphs_hold_the_table_and_not_after_it_closed(
    sglang_checkpoint, load_model, tiny, file_rows, monkeypatch, rng
):
    """A gather captured (injected: no GPU here) holds the open table: a load naming another copy
    (PLE_UM_DIR) is refused, and the table serves on. Once the layer's table is closed (its graphs
    with it), a load opens the new copy and a later remap is not refused by the closed table's
    capture."""
    from ple_um import served

    seed = int(rng.integers(1 << 30))
    directory, layout, _ = sglang_checkpoint("fp8", seed=seed)
    copy, _, _ = sglang_checkpoint("fp8", seed=seed)
    model = load_model(directory, ple_um=True)
    table = tiny.ngram(model).ngram_embedding
    ids = torch.from_numpy(rng.permutation(layout.num_rows)).view(-1, tiny.parts)  # every row, every edge
    with monkeypatch.context() as m:
        m.setattr(served, "capturing", lambda ids: True)
        table.gather(ids)
    assert table.served.captured
    monkeypatch.setenv("PLE_UM_DIR", copy)
    with pytest.raises(RuntimeError, match="moved from .* after CUDA graphs captured its lookup"):
        model.load_weights([])
    assert table.table.layout.directory == os.path.realpath(directory) and not table.table.closed

    table.close_table()
    assert not table.served.captured  # no table open: no graph holds one
    model.load_weights([])
    assert table.table.layout.directory == os.path.realpath(copy) and not table.served.captured
    monkeypatch.setenv("PLE_UM_DIR", directory)
    model.load_weights([])  # no graph captured the copy's table: remapped
    assert table.table.layout.directory == os.path.realpath(directory)
    expected = file_rows(layout).to(torch.bfloat16)[ids]
    assert torch.equal(table.gather(ids).view(torch.uint8), expected.view(torch.uint8))


def test_a_dropped_model_releases_its_table(sglang_checkpoint, load_model, tiny, rng):
    """No layer closes its table on its own, and none needs to: a model dropped without
    ``close_table()`` lets its table go once the garbage collector frees the layer, released on
    ``ple_um.dropped``'s thread (which never synchronizes the device): no mapping of its files left."""
    import gc
    import weakref

    from helpers.dropped_tables import drain
    from helpers.reference import maps_of

    directory, layout, _ = sglang_checkpoint("fp8", seed=int(rng.integers(1 << 30)))
    model = load_model(directory, ple_um=True)
    load_model.models.remove(model)  # the fixture would close it at the end
    table = weakref.ref(tiny.ngram(model).ngram_embedding.table)
    assert maps_of(layout.files)
    del model
    gc.collect()
    assert drain(60)
    assert table() is None and maps_of(layout.files) == []


def test_table_delivered_in_memory_is_compared(sglang_checkpoint, load_model, tiny, file_rows, rng):
    """``load_weights`` with shard tensors in memory (a weight update): equal rows are accepted without a
    copy, different rows raise ReloadMismatchError naming the file and the tensor."""
    from ple_um.sglang.embedding import ReloadMismatchError

    directory, layout, _ = sglang_checkpoint("fp8", seed=int(rng.integers(1 << 30)))
    model = load_model(directory, ple_um=True)
    table = tiny.ngram(model).ngram_embedding
    rows = file_rows(layout)
    spec = layout.shards[1]
    start = layout.shard_start(1)
    shard = rows[start : start + spec.rows].clone()
    loaded = model.load_weights([(spec.tensor, shard)])
    assert (
        table.shards_compared == 1
        and f"model.layers.{tiny.layer}.ple.ple_embedding.ngram_embedding.weight" in loaded
    )
    changed = shard.clone()
    changed.view(torch.uint8)[7, 3] ^= 1
    with pytest.raises(ReloadMismatchError, match=f"at row {start + 7} ") as caught:
        model.load_weights([(spec.tensor, changed)])
    assert spec.path in str(caught.value) and spec.tensor in str(caught.value)


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "f16"])
def test_rows_delivered_in_another_dtype_are_compared_after_stock_cast(
    dtype, sglang_checkpoint, load_model, tiny, file_rows, rng
):
    """Shard rows a weight update delivers in another dtype than the table's (float32, bf16):
    stock SGLang casts them to its table's dtype as it copies them (E4M3 for an E4M3 table, else
    bf16), and so does the comparison. Rows that cast to what the table serves (exact, or float32
    nudged by less than half a step) are taken by both, and the layers return the same rows after;
    a row that casts to another value is refused, naming it, the file and the tensor."""
    from ple_um.delivered import ReloadMismatchError

    directory, layout, _ = sglang_checkpoint(dtype, seed=int(rng.integers(1 << 30)))
    stock = load_model(directory, ple_um=False)
    ours = load_model(directory, ple_um=True)
    table = tiny.ngram(ours).ngram_embedding
    rows, spec, start = file_rows(layout), layout.shards[2], layout.shard_start(2)
    shard = rows[start : start + spec.rows]
    ids = torch.from_numpy(rng.permutation(layout.num_rows)).view(-1, tiny.parts)
    deliveries = [shard.float(), shard.to(torch.bfloat16)]
    if dtype != "f16":  # f16 values may sit on a bf16 tie, where a nudge changes what stock holds
        deliveries.append(shard.float() * (1 + 2.0**-12))
    for delivered in deliveries:
        assert delivered.dtype != layout.dtype or dtype == "bf16"
        for model in (stock, ours):
            model.load_weights([(spec.tensor, delivered.clone())])
        got, expected = table(ids), tiny.ngram(stock).ngram_embedding(ids)
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(got.view(torch.uint8), rows.to(torch.bfloat16)[ids].view(torch.uint8))
    assert table.shards_compared == len(deliveries)
    changed = shard.float()
    changed[11] = changed[11] * 4 + 1
    with pytest.raises(ReloadMismatchError, match=f"shard 2 at row {start + 11} ") as caught:
        ours.load_weights([(spec.tensor, changed)])
    assert spec.path in str(caught.value) and spec.tensor in str(caught.value)


def test_block_scales_delivered_to_a_table_without_them(sglang_checkpoint, load_model, tiny, rng):
    """NVFP4 block scales of a shard delivered in memory (a weight update) to an FP8 table, which has
    none: ReloadMismatchError naming the delivered tensor, the table's rows tensor and its file."""
    from ple_um.checkpoint.naming import block_scale_name
    from ple_um.delivered import ReloadMismatchError

    directory, layout, _ = sglang_checkpoint("fp8", seed=int(rng.integers(1 << 30)))
    model = load_model(directory, ple_um=True)
    spec = layout.shards[1]
    scales = torch.ones(spec.rows, layout.row_dim // 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ReloadMismatchError, match="block scales of shard 1") as caught:
        model.load_weights([(block_scale_name(spec.tensor), scales)])
    message = str(caught.value)
    assert block_scale_name(spec.tensor) in message and spec.tensor in message and spec.path in message
    assert "None" not in message, message
    assert tiny.ngram(model).ngram_embedding.table.layout.directory == layout.directory


def test_stock_model_is_not_loaded_under_ple_um(sglang_checkpoint, load_model, monkeypatch, rng):
    """A model built with PLE_UM unset has stock tables, which SGLang's iterator under PLE_UM would
    leave without rows: its load refuses instead."""
    directory, layout, _ = sglang_checkpoint("fp8", seed=int(rng.integers(1 << 30)))
    model = load_model(directory, ple_um=False)
    monkeypatch.setenv("PLE_UM", "1")
    with pytest.raises(RuntimeError, match="built with stock PLE tables"):
        model.load_weights([])


def _tensor(directory, name: str) -> torch.Tensor:
    """Tensor ``name`` of the checkpoint in ``directory``, read through its index."""
    from safetensors import safe_open

    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    with safe_open(os.path.join(directory, index["weight_map"][name]), framework="pt") as f:
        return f.get_tensor(name).clone()


def test_a_reload_refused_by_the_scale_check_leaves_the_old_table_serving(
    sglang_checkpoint, load_model, tiny, file_rows, monkeypatch, rng
):
    """A reload whose table does not agree with the scale SGLang loaded: PLE_UM_DIR moved to another
    checkpoint's table (b) while the model keeps a's scale, or while a weight update sends a third
    one's (c). The refusal leaves a's table serving, open, b's never served, and ``weight_scale``
    back at a's (SGLang had already copied c's into it), so the layer returns what it returned. The
    reload done right (b's scale) then serves b's rows."""
    from ple_um import synthetic

    seeds = iter(range(int(rng.integers(1 << 30)), 1 << 31))
    (first, first_layout, _), (other, other_layout, _), (third, _, _) = (
        sglang_checkpoint("fp8", seed=next(seeds)) for _ in range(3)
    )
    while _bf16(other_layout.scale) == _bf16(first_layout.scale):  # scales apart even in bf16
        other, other_layout, _ = sglang_checkpoint("fp8", seed=next(seeds))
    model = load_model(first, ple_um=True)
    embedding = tiny.ngram(model).ngram_embedding
    old, scale = embedding.table, embedding.weight_scale.clone()
    ids = torch.from_numpy(rng.permutation(tiny.rows)).view(-1, tiny.parts)
    served = embedding(ids).clone()
    assert torch.equal(
        served.view(torch.uint8), file_rows(first_layout).to(torch.bfloat16)[ids].view(torch.uint8)
    )

    name = synthetic.scale_name(tiny.layer)
    monkeypatch.setenv("PLE_UM_DIR", other)
    for weights in ([], [(name, _tensor(third, name))]):
        with pytest.raises(CheckpointError, match="does not belong to this checkpoint"):
            model.load_weights(weights)
        assert embedding.table is old and not old.closed and embedding.served.staged is None
        assert torch.equal(embedding.weight_scale, scale)
        assert torch.equal(embedding(ids).view(torch.uint8), served.view(torch.uint8))

    model.load_weights([(name, _tensor(other, name))])
    assert old.closed and embedding.table.layout.directory == os.path.realpath(other)
    expected = file_rows(other_layout).to(torch.bfloat16)[ids]
    assert torch.equal(embedding(ids).view(torch.uint8), expected.view(torch.uint8))
    assert float(embedding.weight_scale) == _bf16(other_layout.scale)


def _scale_apart(sglang_checkpoint, layout, seed: int):
    """An FP8 checkpoint (directory, layout) from ``seed`` on whose scale is apart from ``layout``'s
    even in bf16, as SGLang holds ``weight_scale``."""
    for other_seed in range(seed, seed + 100):
        directory, other, _ = sglang_checkpoint("fp8", seed=other_seed)
        if _bf16(other.scale) != _bf16(layout.scale):
            return directory, other
    raise AssertionError("no seed gives a scale apart")


def test_a_reload_whose_table_cannot_open_keeps_the_old_scale(
    sglang_checkpoint, load_model, tiny, file_rows, monkeypatch, rng
):
    """A weight update that copies another checkpoint's FP8 scale into ``weight_scale`` while
    PLE_UM_DIR names a table that does not fit the layer (more rows): refused naming that table's
    file, and the old table serves on with its own scale, as the model multiplies by it."""
    from ple_um import synthetic

    seed = int(rng.integers(1 << 30))
    first, first_layout, _ = sglang_checkpoint("fp8", seed=seed)
    wrong, wrong_layout, _ = sglang_checkpoint("fp8", seed=seed + 1, num_rows=tiny.rows + 8)
    third, third_layout = _scale_apart(sglang_checkpoint, first_layout, seed + 2)
    model = load_model(first, ple_um=True)
    embedding = tiny.ngram(model).ngram_embedding
    old, scale = embedding.table, embedding.weight_scale.clone()
    monkeypatch.setenv("PLE_UM_DIR", wrong)
    name = synthetic.scale_name(tiny.layer)
    with pytest.raises(CheckpointError, match="rows") as caught:
        model.load_weights([(name, _tensor(third, name))])
    assert caught.value.path in wrong_layout.files
    assert embedding.table is old and not old.closed and embedding.served.staged is None
    assert torch.equal(embedding.weight_scale, scale)


def test_a_sync_in_parts_serves_the_old_table_with_its_scale_until_all_is_in(
    sglang_checkpoint, load_model, tiny, file_rows, monkeypatch, rng, caplog
):
    """A weight update after a remap (PLE_UM_DIR moved from a to b) that sends b's FP8 scale with
    one of b's shards: SGLang copies b's scale into ``weight_scale`` at once, but a's table serves on
    under a's scale until all of b's is in; ``stats()["staged"]`` and the log say what b's staged
    table lacks. A next update that sends nothing of it ends that sync, closing b's table. The sync
    sent whole, in two calls, the scale in the first: b's table serves, under b's scale."""
    import logging

    from ple_um import synthetic

    seed = int(rng.integers(1 << 30))
    first, first_layout, _ = sglang_checkpoint("fp8", seed=seed)
    other, other_layout = _scale_apart(sglang_checkpoint, first_layout, seed + 1)
    model = load_model(first, ple_um=True)
    embedding = tiny.ngram(model).ngram_embedding
    old, scale = embedding.table, embedding.weight_scale.clone()
    ids = torch.from_numpy(rng.permutation(tiny.rows)).view(-1, tiny.parts)
    rows_of = {
        path: file_rows(layout).to(torch.bfloat16)[ids]
        for path, layout in ((first, first_layout), (other, other_layout))
    }
    assert embedding.stats()["staged"] is None

    monkeypatch.setenv("PLE_UM_DIR", other)
    names = [synthetic.scale_name(tiny.layer)] + [
        synthetic.shard_name(tiny.layer, i) for i in range(tiny.parts)
    ]
    weights = [(name, _tensor(other, name)) for name in names]
    with caplog.at_level(logging.INFO, logger="ple_um.sglang"):
        model.load_weights(weights[:2])  # the scale and shard 0
    staged = embedding.served.staged[0]
    lacks = [f"shard_{i}.weight" for i in range(1, tiny.parts)]
    assert embedding.stats()["staged"] == {"directory": os.path.realpath(other), "lacks": lacks}
    assert any("stays staged" in r.message for r in caplog.records)
    assert embedding.table is old and torch.equal(embedding.weight_scale, scale)
    assert torch.equal(embedding(ids).view(torch.uint8), rows_of[first].view(torch.uint8))

    model.load_weights([])
    assert staged.closed and embedding.served.staged is None and embedding.table is old
    assert torch.equal(embedding.weight_scale, scale)

    model.load_weights(weights[:3])
    assert embedding.table is old and torch.equal(embedding.weight_scale, scale)
    model.load_weights(weights[3:])
    assert old.closed and embedding.served.staged is None
    assert float(embedding.weight_scale) == _bf16(other_layout.scale)
    assert torch.equal(embedding(ids).view(torch.uint8), rows_of[other].view(torch.uint8))


def _weights_from_disk(model, directory):
    """(loader, weights) as SGLang's ``update_weights_from_disk`` gets them for the model: its
    default loader's weight iterator for ``directory`` (through the plugin's hook under PLE_UM=1)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

    model_config = ModelConfig(directory, language_model_only=True)
    loader = get_model_loader(load_config=LoadConfig(load_format="auto"), model_config=model_config)
    assert isinstance(loader, DefaultModelLoader)
    return loader, loader._get_weights_iterator(DefaultModelLoader.Source.init_new(model_config, model))


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "nvfp4"])
def test_an_update_from_disk_after_part_of_a_sync_serves_the_new_table(
    dtype, sglang_checkpoint, load_model, tiny, file_rows, monkeypatch, rng, caplog
):
    """A weight update that sends part of b's table (PLE_UM_DIR moved from a to b) leaves it staged,
    a's serving. ``update_weights_from_disk`` from b then reads b's table from its files (none of it
    in memory): b's staged table is checked against the scale that load brought and serves, the
    rows b's files hold. A stream of b's files read outside a load tells the layer nothing."""
    import logging

    from helpers.reference import reference_nvfp4

    from ple_um import synthetic

    seed = int(rng.integers(1 << 30))
    first, first_layout, _ = sglang_checkpoint(dtype, seed=seed)
    if dtype == "fp8":
        other, other_layout = _scale_apart(sglang_checkpoint, first_layout, seed + 1)
    else:
        other, other_layout, _ = sglang_checkpoint(dtype, seed=seed + 1)
    model = load_model(first, ple_um=True)
    embedding = tiny.ngram(model).ngram_embedding
    old, scale = embedding.table, embedding.weight_scale.clone()
    ids = torch.from_numpy(rng.permutation(tiny.rows)).view(-1, tiny.parts)  # every row, every edge
    served = embedding.gather(ids).clone()

    monkeypatch.setenv("PLE_UM", "1")  # as in the server, where the loader's hooks see it
    monkeypatch.setenv("PLE_UM_DIR", other)
    sync = [synthetic.shard_name(tiny.layer, 0)]
    if dtype == "fp8":
        sync.insert(0, synthetic.scale_name(tiny.layer))
    if dtype == "nvfp4":
        sync.append(synthetic.block_scale_name(tiny.layer, 0))
    with caplog.at_level(logging.INFO, logger="ple_um.sglang"):
        model.load_weights([(name, _tensor(other, name)) for name in sync])
    assert any("stays staged" in r.message for r in caplog.records)
    staged = embedding.served.staged[0]
    assert embedding.table is old and torch.equal(embedding.weight_scale, scale)

    _, unread = _weights_from_disk(model, other)  # a stream of b's files that no load reads
    assert [name for name, _ in unread]
    assert embedding.served.staged is not None and not embedding.deliveries().files

    loader, weights = _weights_from_disk(model, other)  # update_weights_from_disk(b)
    loader.load_weights_and_postprocess(model, weights, torch.device("cpu"))
    assert embedding.served.staged is None and staged is embedding.table and not staged.closed
    assert old.closed and embedding.table.layout.directory == os.path.realpath(other)
    want = 1.0 if dtype != "fp8" else _bf16(other_layout.scale)
    assert float(embedding.weight_scale) == want
    out = torch.full((*ids.shape, embedding.embedding_dim), float("nan"), dtype=torch.bfloat16)
    embedding.gather(ids, out=out)
    if dtype == "nvfp4":  # SGLang's own layer cannot load NVFP4: the rows decoded from b's files
        reference = reference_nvfp4(other_layout, ids.numpy())
    else:
        reference = tiny.ngram(load_model(other, ple_um=False)).ngram_embedding(ids)
    assert torch.equal(out.view(torch.uint8), reference.view(torch.uint8))
    assert not torch.equal(out.view(torch.uint8), served.view(torch.uint8))
