"""Checkpoint layer: safetensors headers -> a validated ShardLayout of one PLE layer's table.

``layout`` holds the entry points; below it ``scan`` reads the directory (index, files, headers
through ``safetensors``, where the ``safetensors`` package judges them, and ``files``) and holds
``Problems``, where every check reports, ``naming`` knows the tensors' names, ``validation`` checks
them (a table's global scale read among them), and ``shard_layout`` is the data model and the
storage formats (``NVFP4_BLOCK``: the values per NVFP4 block scale).
``engram`` reads a DeepSeek-V4.1 Engram table (MXFP8, one unsplit shard) into the same ShardLayout,
checked against the config's geometry (``engram_geometry``).
"""

from ple_um.checkpoint.engram import read_engram_layout
from ple_um.checkpoint.engram_geometry import EngramGeometry
from ple_um.checkpoint.files import FileIdentity, check_identity
from ple_um.checkpoint.layout import check_shape, find_layers, read_layout, replaced_files, validate
from ple_um.checkpoint.naming import ple_match
from ple_um.checkpoint.shard_layout import MXFP8_BLOCK, NVFP4_BLOCK, ShardLayout, ShardSpec

__all__ = [
    "EngramGeometry",
    "FileIdentity",
    "MXFP8_BLOCK",
    "NVFP4_BLOCK",
    "ShardLayout",
    "ShardSpec",
    "check_identity",
    "check_shape",
    "find_layers",
    "ple_match",
    "read_engram_layout",
    "read_layout",
    "replaced_files",
    "validate",
]
