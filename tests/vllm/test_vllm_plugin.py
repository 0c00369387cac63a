"""The entry point vLLM loads in every process (``ple_um.vllm.plugin``): off unless PLE_UM is set,
idempotent, touching nothing but the Qwen4Exp n-gram embedding, and routing ple-um's log lines
through vLLM's logging."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest
import vllm_harness as h

# Run in a fresh interpreter: loads vLLM's general plugins (ple-um's entry point when the package is
# installed, else register() itself), applies them again, and reports what vLLM symbols look like.
_PROBE = textwrap.dedent(
    """
    import json, sys
    from importlib.metadata import entry_points
    import vllm.plugins
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader import default_loader, weight_utils
    from vllm.models.qwen4_exp.nvidia import ngram_embedding as ng

    names = {
        "ngram_init": lambda: ng.Qwen4ExpNGramEmbedding.__init__,
        "ngram_load_weights": lambda: ng.Qwen4ExpNGramEmbedding.load_weights,
        "device_backend": lambda: ng.Qwen4ExpPLEDeviceEmbedding,
        "pinned_backend": lambda: ng.Qwen4ExpPLEPinnedHostEmbedding,
        "vocab_forward": lambda: VocabParallelEmbedding.forward,
        "loader_load_weights": lambda: default_loader.DefaultModelLoader.load_weights,
        "st_iterator": lambda: weight_utils.safetensors_weights_iterator,
    }
    before = {k: id(get()) for k, get in names.items()}
    via_entry_point = any(e.name == "ple_um" for e in entry_points(group="vllm.general_plugins"))
    vllm.plugins.load_general_plugins()
    if not via_entry_point:
        from ple_um.vllm.plugin import register
        register()
    first = {k: id(get()) for k, get in names.items()}
    from ple_um.vllm.plugin import register
    register()
    register()
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    again = {k: id(get()) for k, get in names.items()}
    from vllm.models.qwen4_exp.nvidia import model
    print(json.dumps({
        "via_entry_point": via_entry_point,
        "changed": sorted(k for k in names if first[k] != before[k]),
        "changed_again": sorted(k for k in names if again[k] != first[k]),
        "ngram_patched": "_ple_um_original" in ng.Qwen4ExpNGramEmbedding.__dict__,
        "model_classes_patched": [
            "_ple_um_original" in getattr(model, c).__dict__
            for c in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
        ],
        "backend_imported": "ple_um.vllm.backend" in sys.modules,
    }))
    """
)


def _probe(**env) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("PLE_UM", "VLLM_PLE_MMAP")}
    clean.update(env)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=clean, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probe_off():
    return _probe()


@pytest.fixture(scope="module")
def probe_on():
    return _probe(VLLM_PLE_MMAP="1")  # the VLLM_PLE_MMAP alias enables it too


@pytest.mark.vllm
@h.needs_vllm
def test_disabled_patches_nothing(probe_off):
    assert probe_off["changed"] == [] and probe_off["changed_again"] == []
    assert not probe_off["ngram_patched"]
    assert not probe_off["backend_imported"]


@pytest.mark.vllm
@h.needs_vllm
def test_enabled_patches_only_the_ngram_embedding_once(probe_on):
    try:
        installed = importlib.metadata.distribution("ple-um") is not None
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert probe_on["via_entry_point"] or not installed  # installed: vLLM itself loads the plugin
    assert probe_on["changed"] == ["ngram_init", "ngram_load_weights"]
    assert probe_on["changed_again"] == []  # loading again changes nothing
    assert probe_on["ngram_patched"]


@pytest.mark.vllm
@h.needs_vllm
def test_enabled_without_ple_layers_leaves_vllm_untouched(probe_on):
    """A model that builds no PLE layer meets stock vLLM: the backends, the embedding, the loader
    and the model classes are vLLM's own; only the n-gram constructor consults PLE_UM."""
    assert "device_backend" not in probe_on["changed"] and "pinned_backend" not in probe_on["changed"]
    assert "vocab_forward" not in probe_on["changed"] and "loader_load_weights" not in probe_on["changed"]
    assert probe_on["model_classes_patched"] == [False, False]


_LOG_PROBE = textwrap.dedent(
    """
    import logging, sys
    from vllm.config import LoggingConfig
    from vllm.logger import configure_logging
    from ple_um.vllm.plugin import register
    if sys.argv[1] == "root":  # a launcher that configured the root logger too
        logging.basicConfig(stream=sys.stdout, level=logging.INFO)
    register()  # as vLLM loads its plugins: before it configures its logging
    register()
    if sys.argv[1] != "off":
        configure_logging(LoggingConfig())
    logging.getLogger("ple_um.metrics").info("ple-um stats (a line for the test)")
    logging.getLogger("ple_um.table").warning("ple-um warning (a line for the test)")
    """
)


@pytest.mark.vllm
@h.needs_vllm
@pytest.mark.parametrize("case", ["vllm", "root", "off", "unset"])
def test_ple_um_lines_reach_vllms_log(case):
    """Under vLLM (PLE_UM=1) the stats line and a table's open line (INFO on ``ple_um.*``) are
    written through vLLM's handler, once each, also when the root logger has a handler of its own;
    with vLLM's logging off (VLLM_CONFIGURE_LOGGING=0) a warning still reaches stderr (logging's
    last resort) and INFO stays silent; without PLE_UM the plugin changes nothing."""
    drop = ("PLE_UM", "VLLM_PLE_MMAP", "VLLM_CONFIGURE_LOGGING")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if case != "unset":
        env["PLE_UM"] = "1"
    if case == "off":
        env["VLLM_CONFIGURE_LOGGING"] = "0"
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stdout"
    command = [sys.executable, "-c", _LOG_PROBE, "vllm" if case == "unset" else case]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    info = [line for line in done.stdout.splitlines() if "stats (a line for the test)" in line]
    warning = [line for line in (done.stdout + done.stderr).splitlines() if "warning (a line" in line]
    if case in ("vllm", "root"):
        assert len(info) == 1 and "INFO" in info[0], done.stdout[-2000:]  # vLLM's format
        assert len(warning) == 1
    else:
        assert info == [] and len(warning) == 1, (done.stdout[-2000:], done.stderr[-2000:])
