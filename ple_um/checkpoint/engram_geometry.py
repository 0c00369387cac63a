"""The geometry of DeepSeek-V4.1's Engram tables: which layers have one, how many rows each has,
the row width, and each hash head's row range, as vLLM 0.33's ``EngramLayout`` gives them
(``ple_um/vllm/engram.py``: ``geometry_of``; ``tools/engram_config.py`` computes the same from a
config without vLLM, for the tests and the lab).

A position is hashed as ``engram_max_ngram_size - 1`` n-grams (2-gram .. max), each split over
``engram_n_heads`` heads; every (layer, n-gram, head) owns a prime-sized range of its layer's
table, the ranges laid out one after the other from row 0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngramGeometry:
    """What the config says of every Engram table: ``layer_ids`` (the model's layer ids, as in the
    checkpoint's names), ``num_rows`` per table, ``head_dim`` (values per row), and per table the
    row count of each hash head in table order (``head_sizes``)."""

    layer_ids: tuple[int, ...]
    num_rows: tuple[int, ...]
    head_dim: int
    head_sizes: tuple[tuple[int, ...], ...]

    def index(self, layer: int) -> int:
        """The position of model layer ``layer`` among the Engram layers; ValueError if it has none."""
        if layer not in self.layer_ids:
            raise ValueError(
                f"layer {layer} is not an Engram layer (engram_layer_ids: {list(self.layer_ids)})"
            )
        return self.layer_ids.index(layer)

    def head_rows(self, layer: int, head_start: int, head_end: int) -> tuple[int, int]:
        """The rows ``[start, end)`` of heads ``[head_start, head_end)`` of ``layer``'s table: one
        contiguous range, since the heads lie one after the other."""
        sizes = self.head_sizes[self.index(layer)]
        if not 0 <= head_start <= head_end <= len(sizes):
            raise ValueError(
                f"heads [{head_start}, {head_end}) outside the {len(sizes)} heads of layer {layer}"
            )
        start = sum(sizes[:head_start])
        return start, start + sum(sizes[head_start:head_end])
