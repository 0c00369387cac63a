"""The machines the tests inject into the probe: DeviceCapabilities as read_capabilities reports
them on a coherent Grace system, on a discrete GPU with HMM, and on a discrete GPU without it
(``from machines import ATS, DISCRETE, HMM``;
conftest puts this folder on the path). A test whose kernels the Triton interpreter runs takes
them onto the "cpu" device with ``dataclasses.replace``."""

from __future__ import annotations

from ple_um.access.capabilities import DeviceCapabilities

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
