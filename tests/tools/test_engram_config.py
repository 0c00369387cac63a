"""``tools/engram_config.py``: the Engram geometry computed from a config equals vLLM 0.33's own
``EngramLayout`` (its primes, in table order), and a config that cannot describe its tables is
refused naming what is wrong."""

from __future__ import annotations

import pytest
from engram_config import geometry_from_config
from helpers.vllm_engram import engram_config, engram_module


def test_geometry_equals_vllms_engram_layout():
    config = engram_config()
    theirs = engram_module().EngramLayout(config)
    ours = geometry_from_config(config)
    assert ours.head_sizes == tuple(tuple(p for order in layer for p in order) for layer in theirs.primes)
    assert (ours.layer_ids, ours.num_rows, ours.head_dim) == ((2, 5), (2700, 3100), 64)


def test_a_config_whose_heads_do_not_fit_is_refused():
    config = vars(engram_config())
    with pytest.raises(ValueError, match="hash heads need"):
        geometry_from_config(dict(config, engram_num_embeddings=[100, 3100]))
    with pytest.raises(ValueError, match="engram_head_dim"):
        geometry_from_config({k: v for k, v in config.items() if k != "engram_head_dim"})
