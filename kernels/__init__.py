"""Triton kernels of ple-um (installed as ``ple_um.kernels``)."""

from ple_um.kernels.gather import STORAGE_CODES, gather_rows

__all__ = ["STORAGE_CODES", "gather_rows"]
