"""The machines the tests inject: DeviceCapabilities as read_capabilities reports them on a
coherent Grace system, on a discrete GPU with HMM, and on a discrete GPU without it
(``from helpers.machines import ATS, DISCRETE, HMM``; conftest puts tests/ on the path); the same
machines on the "cpu" device, whose kernels the Triton interpreter runs (H200, GH200); and
``inject_machine``, which makes open_table see one of them and register through
``InjectedRegistration``."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os

import torch

import ple_um.table
from ple_um.access.capabilities import DeviceCapabilities
from ple_um.access.registration import RegisteredMapping, RegistrationError
from ple_um.mapping import MappedShards, _libc

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
    """cudaHostRegister, cudaHostUnregister and cudaHostGetDevicePointer for RegisteredMapping.

    ``register`` maps the region's bytes a second time (PROT_READ, MAP_SHARED, from the region's
    own fd and offset) and ``device_pointer`` returns that alias: the kernel reads rows only
    through it. ``fail_register=k`` / ``fail_pointer=k`` make the k-th call (0-based) raise
    ``error`` (``fail_register="all"``: every call). Records every call, and whether the mapping
    was still open at each unregister. Serves every MappedShards it is given (an NVFP4 table
    registers its block scales' mapping too)."""

    def __init__(self, *, fail_register=None, fail_pointer=None, error=RegistrationError) -> None:
        self.fail_register, self.fail_pointer, self.error = fail_register, fail_pointer, error
        self.mappings: list[MappedShards] = []
        self.live: dict[int, tuple[int, int, MappedShards]] = {}  # host address -> (alias, length, mapping)
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.register_calls = self.pointer_calls = 0
        self.mapping_open_at_unregister: list[bool] = []

    def register(self, addr: int, length: int) -> None:
        k, self.register_calls = self.register_calls, self.register_calls + 1
        if k == self.fail_register or self.fail_register == "all":
            raise self.error(f"cudaHostRegister({length} bytes) failed: cudaErrorMemoryAllocation (injected)")
        mapping, region = next((m, r) for m in self.mappings for r in m.regions if r.addr == addr)
        assert region.length == length
        alias = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, region.fd, region.file_offset)
        assert alias not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        self.live[addr] = (alias, length, mapping)
        self.registered.append(addr)

    def device_pointer(self, addr: int) -> int:
        k, self.pointer_calls = self.pointer_calls, self.pointer_calls + 1
        if k == self.fail_pointer:
            raise RegistrationError("cudaHostGetDevicePointer failed: cudaErrorInvalidValue (injected)")
        return self.live[addr][0]

    def unregister(self, addr: int) -> None:
        alias, length, mapping = self.live.pop(addr)
        self.mapping_open_at_unregister.append(not mapping.closed)
        assert _libc.munmap(alias, length) == 0
        self.unregistered.append(addr)

    def __call__(self, mapping: MappedShards, device: torch.device, **kwargs) -> RegisteredMapping:
        """What ple_um.table calls in place of RegisteredMapping: the real one, these callables."""
        self.mappings.append(mapping)
        return RegisteredMapping(
            mapping,
            device,
            register=self.register,
            unregister=self.unregister,
            device_pointer=self.device_pointer,
            **kwargs,
        )


def inject_machine(monkeypatch, caps: DeviceCapabilities = H200, **failures) -> InjectedRegistration:
    """From now on (until ``monkeypatch`` undoes it) open_table sees ``caps`` and registers through
    the returned injection. RegisteredMapping binds the CUDA calls as default arguments at
    definition time, so the class is replaced in ple_um.table's namespace by the injection, which
    builds the real RegisteredMapping with its own callables."""
    injected = InjectedRegistration(**failures)
    monkeypatch.setattr(ple_um.table, "read_capabilities", lambda device=None: caps)
    monkeypatch.setattr(ple_um.table, "RegisteredMapping", injected)
    return injected
