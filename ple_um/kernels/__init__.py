"""Triton kernels of ple-um (installed as ``ple_um.kernels``)."""

from ple_um.kernels.gather import STORAGE_CODES, gather_rows
from ple_um.kernels.gather_mxfp8 import gather_mxfp8
from ple_um.kernels.gather_nvfp4 import gather_nvfp4
from ple_um.kernels.launch import DirectLaunch

__all__ = ["STORAGE_CODES", "DirectLaunch", "gather_mxfp8", "gather_nvfp4", "gather_rows"]
