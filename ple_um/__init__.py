"""ple-um: serve a huge read-only embedding table straight from its safetensors shards.

The shards are mmapped read-only, made addressable by the GPU (ATS on coherent Grace systems,
read-only cudaHostRegister on discrete GPUs) and rows are gathered by a Triton kernel; a CPU
gather is the fallback a probe selects at start-up. See DESIGN.md for the contract.
"""

from ple_um import synthetic
from ple_um.access.probe import ProbeReport, probe
from ple_um.errors import CheckpointError, ModeUnavailableError, PleUmError, TableClosedError
from ple_um.table import MappedTable, open_table

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "MappedTable",
    "ModeUnavailableError",
    "PleUmError",
    "ProbeReport",
    "TableClosedError",
    "open_table",
    "probe",
    "synthetic",
]
