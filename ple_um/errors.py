"""The typed errors ple-um raises. Each names what it is about: the file, the tensor, the mode."""

from __future__ import annotations


class PleUmError(Exception):
    """Base class of every error ple-um raises on purpose."""


class CheckpointError(PleUmError, ValueError):
    """A checkpoint cannot serve as a PLE table: the message names the file and the tensor."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        where = []
        if path is not None:
            where.append(f"file {path}")
        if tensor is not None:
            where.append(f"tensor {tensor}")
        full = f"{message} ({', '.join(where)})" if where else message
        super().__init__(full)
        self.message = message  # without the file and tensor it names
        self.path = path
        self.tensor = tensor


class HostError(PleUmError, OSError):
    """This machine lacks what a check needs (an OS facility, address space): no checkpoint file is
    at fault; the message says what is missing."""


class KnobError(PleUmError, ValueError):
    """An environment knob holds a value it does not accept: the message names the variable, the
    value and what is accepted."""


class ModeUnavailableError(PleUmError, RuntimeError):
    """A forced access mode cannot work on this machine; the message says why."""

    def __init__(self, mode: str, reason: str) -> None:
        super().__init__(f"access mode {mode!r} is not available: {reason}")
        self.mode = mode
        self.reason = reason


class TableClosedError(PleUmError, RuntimeError):
    """A table was used after close()."""
