"""The entry point: SGLang's own ``load_plugins()`` finds it, and with PLE_UM=1 (only then) the hooks
are applied."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

# Run by a fresh interpreter: SGLang's load_plugins() loads plugins once per process.
_CHILD = """
import json
from sglang.srt.models import qwen4_exp
from sglang.srt.model_loader.loader import DefaultModelLoader
from sglang.srt.plugins import load_plugins
load_plugins()
print(json.dumps({
    "offload_class": qwen4_exp.Qwen4ExpPinnedHostEmbedding.__name__,
    "wrapped": sorted(
        name
        for name, fn in [
            ("ngram_init", qwen4_exp.Qwen4ExpNGramEmbedding.__init__),
            ("ple_layer_init", qwen4_exp.Qwen4ExpPLELayer.__init__),
            ("load_weights", qwen4_exp.Qwen4ExpForConditionalGeneration.load_weights),
            ("weights_iterator", DefaultModelLoader._get_weights_iterator),
        ]
        if hasattr(fn, "__wrapped__")
    ),
}))
"""


def _child(ple_um: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PLE_UM", "VLLM_PLE_MMAP", "SGLANG_PLUGINS")}
    if ple_um:
        env["PLE_UM"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_entry_point_is_discovered():
    from ple_um.sglang.plugin import register

    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "ple_um"]
    assert len(found) == 1 and found[0].value == "ple_um.sglang.plugin:register"
    assert found[0].load() is register


def test_load_plugins_applies_the_hooks_only_with_ple_um():
    assert _child(ple_um=True) == {
        "offload_class": "PleUmHostEmbedding",
        "wrapped": ["load_weights", "ngram_init", "ple_layer_init", "weights_iterator"],
    }
    assert _child(ple_um=False) == {"offload_class": "Qwen4ExpPinnedHostEmbedding", "wrapped": []}


def test_hooks_applied_in_this_process(sglang_world):
    """The session's load_plugins() (conftest) replaced the offload class wherever SGLang names it."""
    from sglang.srt.models import qwen4_exp

    from ple_um.sglang import hooks
    from ple_um.sglang.embedding import PleUmHostEmbedding, applied

    assert applied()
    assert qwen4_exp.Qwen4ExpPinnedHostEmbedding is PleUmHostEmbedding
    stock = [
        base for base in PleUmHostEmbedding.__mro__[1:] if base.__name__ == "Qwen4ExpPinnedHostEmbedding"
    ]
    assert len(stock) == 1 and stock[0].__module__ == qwen4_exp.__name__  # a subclass of the stock class
    assert hooks.register() == []  # idempotent
