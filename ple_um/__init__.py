"""ple-um: serve a huge read-only embedding table straight from its safetensors shards.

The shards are mmapped read-only, made addressable by the GPU (ATS on coherent Grace systems,
read-only cudaHostRegister on discrete GPUs) and rows are gathered by a Triton kernel; a CPU
gather is the fallback a probe selects at start-up. docs/DESIGN.md maps the package and states the
contract.
"""

from ple_um import synthetic
from ple_um.access.probe import ProbeReport
from ple_um.errors import CheckpointError, HostError, ModeUnavailableError, PleUmError, TableClosedError
from ple_um.opening import open_engram_table, open_table, probe
from ple_um.table import MappedTable
from ple_um.version import __version__

__all__ = [
    "__version__",
    "CheckpointError",
    "HostError",
    "MappedTable",
    "ModeUnavailableError",
    "PleUmError",
    "ProbeReport",
    "TableClosedError",
    "open_engram_table",
    "open_table",
    "probe",
    "synthetic",
]
