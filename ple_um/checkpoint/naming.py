"""The names of a PLE table's tensors in a Qwen4Exp checkpoint, under any prefix:

- ``...layers.<L>.ple.ple_embedding.ngram_embedding.shard_<i>.weight``: the rows of shard ``i``;
- ``...ngram_embedding.weight_scale``: an FP8 table's global scale (refused next to NVFP4, as vLLM
  refuses it);
- ``...ngram_embedding.shard_<i>.weight_scale``: an NVFP4 shard's block scales;
- ``...ngram_embedding.weight_scale_2``: an NVFP4 table's global scale.

And a DeepSeek-V4.1 Engram table's (``engram``): ``...layers.<L>.engram.embed.weight``, its rows,
and ``...layers.<L>.engram.embed.scale``, its E8M0 block scales.
"""

from __future__ import annotations

import re

_PLE = r"(?:^|\.)layers\.([0-9]+)\.ple\.ple_embedding\.ngram_embedding\."
SHARD_RE = re.compile(_PLE + r"shard_([0-9]+)\.weight\Z")
SCALE_RE = re.compile(_PLE + r"weight_scale\Z")
BLOCK_SCALE_RE = re.compile(_PLE + r"shard_([0-9]+)\.weight_scale\Z")  # NVFP4: per shard
GLOBAL_SCALE_RE = re.compile(_PLE + r"weight_scale_2\Z")  # NVFP4: the global scale

ENGRAM_RE = re.compile(r"(?:^|\.)layers\.([0-9]{1,9})\.engram\.embed\.(weight|scale)\Z")

_KINDS = (
    ("shard", SHARD_RE),
    ("block_scale", BLOCK_SCALE_RE),
    ("scale", SCALE_RE),
    ("global_scale", GLOBAL_SCALE_RE),
)


def ple_match(name: str) -> tuple[int, str, int | None] | None:
    """(layer, kind, shard index or None) when ``name`` is a PLE tensor, else None.

    ``kind`` is "shard" (rows), "block_scale" (an NVFP4 shard's block scales), "scale" (the FP8
    scale) or "global_scale" (NVFP4's weight_scale_2); the index is given for the first two.
    Indices of more than 9 digits are taken as no match: no real table has them, and int() of a
    several-thousand-digit name would raise.
    """
    for kind, pattern in _KINDS:
        match = pattern.search(name)
        if match is None:
            continue
        if any(len(g) > 9 for g in match.groups()):
            return None
        index = int(match.group(2)) if match.lastindex == 2 else None
        return int(match.group(1)), kind, index
    return None


def engram_match(name: str) -> tuple[int, str, int] | None:
    """(layer, kind, 0) when ``name`` is an Engram table's tensor, else None: its one unsplit shard,
    so that the scan finds its rows as "shard" 0 and its E8M0 scales as "block_scale" 0."""
    match = ENGRAM_RE.search(name)
    if match is None:
        return None
    return int(match.group(1)), "shard" if match.group(2) == "weight" else "block_scale", 0


def _table_prefix(shard: str) -> str:
    """``...ngram_embedding.`` of a shard tensor's name."""
    return shard[: shard.rindex("shard_")]


def scale_name(shard: str) -> str:
    """The FP8 global scale expected beside the rows tensor ``shard``."""
    return _table_prefix(shard) + "weight_scale"


def global_scale_name(shard: str) -> str:
    """The NVFP4 global scale expected beside the rows tensor ``shard``."""
    return _table_prefix(shard) + "weight_scale_2"


def block_scale_name(shard: str) -> str:
    """The NVFP4 block scales expected beside the rows tensor ``shard`` (``shard_<i>.weight_scale``)."""
    return shard + "_scale"


def rows_name(block_scales: str) -> str:
    """The rows tensor that the NVFP4 block scales ``block_scales`` belong to."""
    return block_scales.removesuffix("_scale")
