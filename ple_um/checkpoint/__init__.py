"""Checkpoint layer: safetensors headers -> a validated ShardLayout of one PLE layer's table."""

from ple_um.checkpoint.layout import ShardLayout, ShardSpec, find_layers, read_layout, validate

__all__ = ["ShardLayout", "ShardSpec", "find_layers", "read_layout", "validate"]
