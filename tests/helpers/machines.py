"""The machines the tests inject: DeviceCapabilities as read_capabilities reports them on a
coherent Grace system, on a discrete GPU with HMM, and on a discrete GPU without it
(``from helpers.machines import ATS, DISCRETE, HMM``; conftest puts tests/ on the path); the same
machines on the "cpu" device, whose kernels the Triton interpreter runs (H200, GH200); and
``injected_machine``, which makes open_table see one of them and register through
``InjectedRegistration``."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
from collections.abc import Iterator

from ple_um.access import machine
from ple_um.access.capabilities import DeviceCapabilities
from ple_um.access.machine import HostRegistration, RegistrationError
from ple_um.mapping import _libc

# A coherent Grace system (GH200, GB10 / DGX Spark): the GPU walks the CPU's page tables.
ATS = DeviceCapabilities(
    cuda=True,
    device="cuda:0",
    name="NVIDIA GH200 480GB",
    pageable_memory_access=True,
    pageable_memory_access_uses_host_page_tables=True,
    host_register_supported=True,
    read_only_host_register_supported=True,
    can_use_host_pointer_for_registered_mem=True,
    uuid="GPU-00000000-0000-0000-0000-0000000000a5",
    driver_version="580.95.05",
)
# A discrete GPU on x86 whose driver runs HMM (open kernel modules, Linux 6.1.24+): it may
# dereference pageable host memory, the driver serving its faults; no host page tables.
HMM = DeviceCapabilities(
    cuda=True,
    device="cuda:0",
    name="NVIDIA RTX PRO 6000 (HMM)",
    pageable_memory_access=True,
    host_register_supported=True,
    read_only_host_register_supported=True,
    can_use_host_pointer_for_registered_mem=True,
    uuid="GPU-00000000-0000-0000-0000-00000000004d",
    driver_version="580.95.05",
)
# A discrete GPU (H200 on x86): read-only host registration, no ATS, no HMM.
DISCRETE = DeviceCapabilities(
    cuda=True,
    device="cuda:0",
    name="NVIDIA H200",
    host_register_supported=True,
    read_only_host_register_supported=True,
    can_use_host_pointer_for_registered_mem=True,
    uuid="GPU-00000000-0000-0000-0000-000000000200",
    driver_version="580.159.04",
)

# The injected machines on the "cpu" device, whose kernels the Triton
# interpreter runs: an H200 on x86 (read-only host registration, no ATS), and a coherent Grace
# system (the GPU walks the host's page tables, so the ats mode reads the mapping's host
# addresses; registration there populates).
H200 = dataclasses.replace(DISCRETE, device="cpu", name="NVIDIA H200 (injected)")
GH200 = dataclasses.replace(ATS, device="cpu", name="NVIDIA GH200 (injected)")


class InjectedRegistration:
    """cudaHostRegister, cudaHostUnregister and cudaHostGetDevicePointer, injected as the machine's
    registration calls (``calls``).

    ``register`` maps the range's pages a second time (``mremap`` with an old size of 0, which
    duplicates a shared mapping) and ``device_pointer`` returns that alias: the kernel reads rows
    only through it, as a GPU reads registered pages through the pointer CUDA returns.
    ``fail_register=k`` / ``fail_pointer=k`` / ``fail_unregister=k`` make the k-th call (0-based)
    raise ``error`` (``fail_register="all"``: every call; a failed unregister drops its alias all
    the same and is not recorded in ``unregistered``). Records every call, and whether the range was still
    mapped at each unregister (the registration released before the mapping)."""

    def __init__(
        self, *, fail_register=None, fail_pointer=None, fail_unregister=None, error=RegistrationError
    ) -> None:
        self.fail_register, self.fail_pointer, self.error = fail_register, fail_pointer, error
        self.fail_unregister = fail_unregister
        self.live: dict[int, tuple[int, int]] = {}  # host address -> (alias, length)
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.register_calls = self.pointer_calls = self.unregister_calls = 0
        self.mapping_open_at_unregister: list[bool] = []
        self.calls = HostRegistration(self.register, self.unregister, self.device_pointer)

    def register(self, addr: int, length: int) -> None:
        k, self.register_calls = self.register_calls, self.register_calls + 1
        if k == self.fail_register or self.fail_register == "all":
            raise self.error(f"cudaHostRegister({length} bytes) failed: cudaErrorMemoryAllocation (injected)")
        alias = _mremap(addr, 0, length, _MREMAP_MAYMOVE)
        assert alias not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        self.live[addr] = (alias, length)
        self.registered.append(addr)

    def device_pointer(self, addr: int) -> int:
        k, self.pointer_calls = self.pointer_calls, self.pointer_calls + 1
        if k == self.fail_pointer:
            raise RegistrationError("cudaHostGetDevicePointer failed: cudaErrorInvalidValue (injected)")
        return self.live[addr][0]

    def unregister(self, addr: int) -> None:
        alias, length = self.live.pop(addr)
        vec = (ctypes.c_ubyte * ((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        self.mapping_open_at_unregister.append(_libc.mincore(addr, length, vec) == 0)  # ENOMEM: unmapped
        assert _libc.munmap(alias, length) == 0
        k, self.unregister_calls = self.unregister_calls, self.unregister_calls + 1
        if k == self.fail_unregister:
            raise self.error("cudaHostUnregister failed: cudaErrorHostMemoryNotRegistered (injected)")
        self.unregistered.append(addr)


_MREMAP_MAYMOVE = 1
_mremap = _libc.mremap
_mremap.restype = ctypes.c_void_p
_mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]


@contextlib.contextmanager
def injected_machine(
    caps: DeviceCapabilities = H200, *, register: bool = True, **failures
) -> Iterator[InjectedRegistration]:
    """Inside the body, open_table sees ``caps`` and registers through the returned injection
    (``ple_um.access.machine.injected``, the package's hook for this); ``register=False``: through
    CUDA's own calls (which fail on a machine without CUDA)."""
    injected = InjectedRegistration(**failures)
    with machine.injected(capabilities=caps, registration=injected.calls if register else None):
        yield injected
