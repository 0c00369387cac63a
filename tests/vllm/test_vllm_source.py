"""Where the backend looks for the table (``ple_um.vllm.source``): PLE_UM_DIR, the model path, the
Hugging Face cache snapshot, and the errors that say what was tried; and file-backed tensors told
from tensors in memory. The resolution tests need no vLLM; the loads do."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch
import vllm_harness as h

import ple_um
from ple_um.vllm.source import TableSource, file_backing, resolve_table_dir


@pytest.mark.vllm
@h.needs_vllm
def test_no_checkpoint_directory(world, patched, monkeypatch, tmp_path):
    """No PLE_UM_DIR and no model path: the error lists what was tried."""
    monkeypatch.delenv("PLE_UM_DIR", raising=False)
    monkeypatch.delenv("VLLM_PLE_MMAP_DIR", raising=False)
    config = h.text_config(fp8=False)
    layout = h.write_table(tmp_path / "ckpt", config, fp8=False)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError) as info:
        h.load(module, layout.directory)
    message = str(info.value)
    assert "PLE_UM_DIR" in message and "model path" in message


@pytest.mark.vllm
@h.needs_vllm
def test_missing_directory_named(world, patched, monkeypatch, tmp_path):
    missing = tmp_path / "not-there"
    monkeypatch.delenv("PLE_UM_DIR", raising=False)
    monkeypatch.setenv("VLLM_PLE_MMAP_DIR", str(missing))  # the VLLM_PLE_MMAP_DIR alias
    config = h.text_config(fp8=False)
    layout = h.write_table(tmp_path / "ckpt", config, fp8=False)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="VLLM_PLE_MMAP_DIR=.*not-there.*is not a directory"):
        h.load(module, layout.directory)


@pytest.mark.vllm
@h.needs_vllm
def test_directory_without_table(world, patched, table_dir, tmp_path):
    config = h.text_config(fp8=False)
    layout = h.write_table(tmp_path / "ckpt", config, fp8=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    table_dir(empty)
    module = h.build(config, ple_um_on=True)
    with pytest.raises(ple_um.CheckpointError, match="empty"):
        h.load(module, layout.directory)


@pytest.fixture
def no_dir_knob(monkeypatch):
    monkeypatch.delenv("PLE_UM_DIR", raising=False)
    monkeypatch.delenv("VLLM_PLE_MMAP_DIR", raising=False)


def test_resolve_model_path(no_dir_knob, tmp_path):
    assert resolve_table_dir(str(tmp_path)) == str(tmp_path)


def test_resolve_knob_first(monkeypatch, tmp_path):
    table = tmp_path / "table"
    table.mkdir()
    monkeypatch.setenv("PLE_UM_DIR", str(table))
    assert resolve_table_dir(str(tmp_path)) == str(table)


def test_resolve_hf_snapshot(no_dir_knob, tmp_path):
    pytest.importorskip("huggingface_hub")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text(commit)
    assert resolve_table_dir("acme/tiny", None, str(tmp_path / "hub")) == str(snapshot)


def test_resolve_error_says_what_was_tried(no_dir_knob, tmp_path):
    with pytest.raises(ple_um.CheckpointError) as info:
        resolve_table_dir("acme/absent", "v1", str(tmp_path / "hub"))
    message = str(info.value)
    for part in ("PLE_UM_DIR", "'acme/absent': not a local directory", "Hugging Face cache", "v1"):
        assert part in message


def vllm_config(model: str) -> SimpleNamespace:
    """The fields of vLLM's config TableSource reads (by attribute)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None),
        load_config=SimpleNamespace(download_dir=None),
    )


def test_table_source_is_the_real_directory(no_dir_knob, tmp_path):
    """A checkpoint reached through a symlink: its real path (one table for the PLE layers and
    Engram alike, however it is spelled), and its files told from others by their real paths."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.safetensors").write_bytes(b"")
    (tmp_path / "link").symlink_to(real)
    source = TableSource(vllm_config(str(tmp_path / "link")))
    assert source.directory() == os.path.realpath(real)
    assert source.is_table_file(str(tmp_path / "link" / "a.safetensors"))
    assert not source.is_table_file(str(tmp_path / "b.safetensors"))


def test_an_unlistable_directory_is_a_checkpoint_error_naming_it(no_dir_knob, tmp_path, monkeypatch):
    """listdir refused (injected: root lists any directory): CheckpointError naming the directory."""
    directory, listdir = os.path.realpath(tmp_path), os.listdir

    def refused(path="."):
        if os.fspath(path) == directory:
            raise PermissionError(13, "Permission denied", directory)
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refused)
    with pytest.raises(
        ple_um.CheckpointError, match=f"cannot list .* {re.escape(directory)}: .*Permission denied"
    ):
        TableSource(vllm_config(str(tmp_path))).directory()


def test_file_backing_tells_file_views_from_memory(tmp_path):
    from safetensors import safe_open

    layout = ple_um.synthetic.write_checkpoint(tmp_path, num_rows=40, row_dim=16, dtype="bf16", shards=3)
    spec = layout.shards[1]
    with safe_open(spec.path, framework="pt") as f:
        view = f.get_tensor(spec.tensor)
        assert file_backing(view) == (os.path.realpath(spec.path), spec.offset)
        assert file_backing(view.clone()) is None
    assert file_backing(torch.zeros(4)) is None


def hub_snapshot(tmp_path) -> tuple:
    """(snapshot, the fields of vLLM's config for ``vllm serve acme/tiny --download-dir <hub>``): a
    Hugging Face cache under ``tmp_path / "hub"`` whose snapshot of acme/tiny holds only its config,
    what vLLM fetches before it loads any weight."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text("{}")
    return snapshot, SimpleNamespace(
        model_config=SimpleNamespace(model="acme/tiny", revision=None),
        load_config=SimpleNamespace(download_dir=str(tmp_path / "hub")),
    )


@pytest.mark.vllm
@h.needs_vllm
def test_a_hub_snapshot_downloaded_while_loading(world, patched, no_dir_knob, tmp_path):
    """A repo id served for the first time: vLLM has fetched only the config into the Hugging Face
    cache snapshot when the model's load_weights starts, and its weight iterator downloads the
    weights into that snapshot at its first step. The plugin leaves the header check to the open,
    skips every shard as a view of the table's files (reads none), and serves stock's rows."""
    from ple_um.vllm.patch import _model_load_weights

    snapshot, hub = hub_snapshot(tmp_path)
    config = h.text_config(fp8=True)
    holder = torch.nn.Module()
    holder.add_module("ple", h.build(config, ple_um_on=True))
    backend = holder.ple.ngram_embedding
    backend.source = TableSource(hub)  # the layer as built under that config

    def vllm_weights():  # DefaultModelLoader.get_all_weights: the download is its first step
        h.write_table(snapshot, config, fp8=True)
        yield from h.checkpoint_weights(snapshot)

    load_weights = _model_load_weights(lambda model, weights: model.ple.load_weights(weights))
    try:
        load_weights(holder, vllm_weights())
        assert backend.table.layout.directory == os.path.realpath(snapshot)
        assert (backend.shards_skipped, backend.shards_compared) == (h.PARTS, 0)
        stock = h.stock(config, snapshot)
        for seed in range(3):
            assert h.same_bits(h.forward(holder.ple, seed)[0], h.forward(stock, seed)[0])
    finally:
        backend.close_table()


def test_awaits_download_only_for_an_incomplete_hub_snapshot(no_dir_knob, tmp_path, monkeypatch):
    """A Hugging Face snapshot awaits its download while it holds no weights, or fewer files than its
    index names; a complete one, a local model directory and PLE_UM_DIR's never do."""
    snapshot, hub = hub_snapshot(tmp_path)
    source = TableSource(hub)
    assert source.awaits_download()
    layout = ple_um.synthetic.write_checkpoint(snapshot, num_rows=40, row_dim=16, dtype="bf16", shards=3)
    assert len(layout.files) > 1 and not source.awaits_download()
    os.unlink(layout.files[0])  # an interrupted download: the index names a file not there
    assert source.awaits_download()
    assert not TableSource(vllm_config(str(snapshot))).awaits_download()  # a local directory
    monkeypatch.setenv("PLE_UM_DIR", str(snapshot))
    assert not TableSource(hub).awaits_download()


@pytest.mark.vllm
@h.needs_vllm
def test_ple_um_dir_pins_the_table_through_a_reload_from_another_path(
    world, patched, table_dir, tmp_path, monkeypatch, caplog
):
    """PLE_UM_DIR set, vLLM reloads from another checkpoint path (``reload_weights(weights_path=)``
    moves its model path): the table stays PLE_UM_DIR's (a BF16 table: no global scale to disagree),
    the new files' shard views are not read, and the log says so once, naming both paths and
    PLE_UM_DIR."""
    import logging

    from ple_um.vllm import source

    monkeypatch.setattr(source, "_pinned_said", set(), raising=False)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # vLLM may route it elsewhere
    config = h.text_config(fp8=False)
    first = h.write_table(table_dir(tmp_path / "a"), config, fp8=False, seed=0)
    second = h.write_table(tmp_path / "b", config, fp8=False, seed=5)
    module = h.build(config, ple_um_on=True)
    backend = module.ngram_embedding
    engine_config = vllm_config(first.directory)
    backend.source = TableSource(engine_config)  # the layer as built under that config
    h.load(module, first.directory)
    table = backend.table
    stock = h.stock(config, first.directory)

    def pinned_lines():
        return [r.getMessage() for r in caplog.records if "PLE_UM_DIR pins" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="vllm.ple_um"):
        h.load(module, first.directory)  # a reload from the same path says nothing
        assert pinned_lines() == []
        engine_config.model_config.model = second.directory
        for _ in range(2):
            h.load(module, second.directory)
    lines = pinned_lines()
    assert len(lines) == 1, lines
    assert first.directory in lines[0] and second.directory in lines[0]
    assert backend.table is table and not table.closed and backend.shards_compared == 0
    for seed in (0, 1):
        assert h.same_bits(h.forward(module, seed)[0], h.forward(stock, seed)[0])
    backend.close_table()
