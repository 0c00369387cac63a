"""Triton kernels of ple-um (installed as ``ple_um.kernels``)."""

from ple_um.kernels.gather import STORAGE_CODES, gather_rows
from ple_um.kernels.gather_block_scaled import gather_block_scaled
from ple_um.kernels.launch import DirectLaunch

__all__ = ["STORAGE_CODES", "DirectLaunch", "gather_block_scaled", "gather_rows"]
