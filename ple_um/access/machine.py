"""The machine the open path sees: each device's capabilities, and CUDA's host-registration calls.

``open_table``, ``probe`` and the first-read check ask ``capabilities(device)``; the registered mode
(and the ats mode's populate) register through ``registration()``. By default these are the real
ones: ``read_capabilities`` and the CUDA runtime's ``cudaHostRegister`` /
``cudaHostUnregister`` / ``cudaHostGetDevicePointer``.

``injected(capabilities=..., registration=...)`` puts another machine in place for the body of a
``with``: what a test uses to open a table as on an H200 or a Grace system while running on a CPU
machine (the kernels under the Triton interpreter), or to make a registration fail at a chosen
call. It is the one way to inject a machine; nothing else in the package reads an override.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ple_um.access.capabilities import DeviceCapabilities, read_capabilities
from ple_um.errors import PleUmError

logger = logging.getLogger(__name__)


class RegistrationError(PleUmError, RuntimeError):
    """cudaHostRegister or cudaHostGetDevicePointer failed; earlier registrations were released."""


def _cuda_register(addr: int, length: int) -> None:
    from cuda.bindings import runtime as rt

    flags = rt.cudaHostRegisterMapped | rt.cudaHostRegisterReadOnly | rt.cudaHostRegisterPortable
    (err,) = rt.cudaHostRegister(addr, length, flags)
    if int(err) != 0:
        raise RegistrationError(f"cudaHostRegister({length} bytes) failed: {err}")


def _cuda_unregister(addr: int) -> None:
    from cuda.bindings import runtime as rt

    (err,) = rt.cudaHostUnregister(addr)
    if int(err) != 0:
        logger.warning("cudaHostUnregister failed: %s", err)


def _cuda_device_pointer(addr: int) -> int:
    from cuda.bindings import runtime as rt

    err, dptr = rt.cudaHostGetDevicePointer(addr, 0)
    if int(err) != 0:
        raise RegistrationError(f"cudaHostGetDevicePointer failed: {err}")
    return int(dptr)


@dataclass(frozen=True)
class HostRegistration:
    """The three calls that register host memory for a device: ``register(addr, length)`` (raises
    RegistrationError), ``unregister(addr)``, ``device_pointer(addr) -> int``."""

    register: Callable[[int, int], None]
    unregister: Callable[[int], None]
    device_pointer: Callable[[int], int]


CUDA_REGISTRATION = HostRegistration(_cuda_register, _cuda_unregister, _cuda_device_pointer)

_lock = threading.Lock()
_stack: list[tuple[DeviceCapabilities | None, HostRegistration | None]] = []


def _innermost(part: int):
    """Part ``part`` (0: capabilities, 1: registration) of the innermost machine that injects it."""
    with _lock:
        return next((entry[part] for entry in reversed(_stack) if entry[part] is not None), None)


def capabilities(device: str | int | torch.device | None = None) -> DeviceCapabilities:
    """The capabilities of ``device``: the injected machine's (for every device), else read."""
    return _innermost(0) or read_capabilities(device)


def registration() -> HostRegistration:
    """The host-registration calls: the injected machine's, else CUDA's."""
    return _innermost(1) or CUDA_REGISTRATION


@contextlib.contextmanager
def injected(
    capabilities: DeviceCapabilities | None = None, registration: HostRegistration | None = None
) -> Iterator[None]:
    """Inside the body, the machine has ``capabilities`` (every device) and registers through
    ``registration`` (either left None: the real one). Nests; undone on exit."""
    entry = (capabilities, registration)
    with _lock:
        _stack.append(entry)
    try:
        yield
    finally:
        with _lock:
            _stack.remove(entry)
