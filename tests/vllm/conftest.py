"""vLLM integration tests: real vLLM 0.33 on the CPU, marked ``vllm`` and skipped only when vLLM is
not installed (``vllm_harness.needs_vllm``).

The folder mirrors ``ple_um/vllm``: ``test_vllm_<module>.py`` tests ``ple_um.vllm.<module>``
(``test_vllm_backend*``: the layer, NVFP4 tables, two ranks). ``test_contract_*.py`` check, stock
against ple-um, the behaviours vLLM's own PLE tests pin down. ``vllm_harness.py`` (building, loading
and running the real layer) and ``two_rank_worker.py`` (one rank of the two-rank runs) are the
shared helpers, imported by file name.

One gloo world of one rank serves every in-process test of this folder (``world``); the two-rank
tests run their own processes. The plugin's patch is applied once (``patched``); each layer is built
stock or ple-um by the PLE_UM value at build time.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import vllm_harness`


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    import vllm_harness

    with vllm_harness.vllm_world(str(tmp_path_factory.mktemp("world"))) as config:
        yield config


@pytest.fixture(scope="session")
def patched():
    """The plugin's register() with PLE_UM=1: Qwen4ExpNGramEmbedding is patched for the session."""
    from ple_um.vllm.plugin import register

    with pytest.MonkeyPatch.context() as m:
        m.setenv("PLE_UM", "1")
        register()
    yield


@pytest.fixture
def table_dir(monkeypatch):
    """``table_dir(path)``: serve the table from ``path`` (PLE_UM_DIR; the test world has no model config)."""

    def use(path):
        monkeypatch.setenv("PLE_UM_DIR", os.fspath(path))
        return path

    monkeypatch.delenv("VLLM_PLE_MMAP_DIR", raising=False)
    return use


@pytest.fixture
def stock_and_mapped(world, patched):
    """``pair(config, directory, **build_args)``: (stock, mapped), the real Qwen4ExpNGramEmbedding
    built twice the way vLLM's model builds it and loaded through its real ``load_weights`` from
    ``directory``: with the stock device backend, and with the plugin in effect (asserted by the
    backend's class). The mapped layers' tables are closed after the test."""
    import vllm_harness

    from ple_um.vllm.backend import Qwen4ExpPLEMappedEmbedding

    opened = []

    def make(config, directory, **build_args):
        stock = vllm_harness.stock(config, directory, **build_args)
        mapped = vllm_harness.mapped(config, directory, **build_args)
        assert type(stock.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"
        assert isinstance(mapped.ngram_embedding, Qwen4ExpPLEMappedEmbedding)
        opened.append(mapped.ngram_embedding)
        return stock, mapped

    yield make
    for backend in opened:
        backend.close_table()
