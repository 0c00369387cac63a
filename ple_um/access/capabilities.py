"""What a device offers for reading host memory, read through cuda-python (cuda.bindings).

The attributes that pick an access mode:
- ``pageable_memory_access_uses_host_page_tables`` (cudaDevAttrPageableMemoryAccessUsesHostPageTables):
  the GPU walks the CPU's page tables (ATS). True on coherent Grace systems (GH200, GB200, GB10 /
  DGX Spark): the GPU can dereference any host address, an mmap of a file included, and the OS
  serves its faults (CUDA Programming Guide, "System-Allocated Memory" / "Hardware Coherency").
- ``pageable_memory_access`` (cudaDevAttrPageableMemoryAccess): the GPU can access pageable memory
  at all. With it but without host page tables the device runs HMM (Linux's Heterogeneous Memory
  Management, open kernel modules): the driver serves the GPU's faults on host addresses in
  software (CUDA Programming Guide, "Unified Memory on Devices with Full CUDA Unified Memory
  Support").
- ``uuid`` and ``driver_version``: what names this GPU and its driver in the first-read verdict's
  cache key (``ple_um.access.first_read``).
- ``host_register_supported`` and ``read_only_host_register_supported``
  (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, read through the driver API because the
  runtime enum of cuda-bindings 13 lacks it): cudaHostRegister with the ReadOnly flag, which a
  ``PROT_READ`` file mapping needs.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class DeviceCapabilities:
    """The facts the probe decides on. Tests build these directly to inject a machine."""

    cuda: bool  # a CUDA device is present and usable
    device: str  # "cuda:0", "cpu"
    name: str = ""
    pageable_memory_access: bool = False
    pageable_memory_access_uses_host_page_tables: bool = False
    host_register_supported: bool = False
    read_only_host_register_supported: bool = False
    can_use_host_pointer_for_registered_mem: bool = False
    integrated: bool = False
    # The device is the host itself: the Triton interpreter runs kernels on the CPU, where a
    # kernel dereferences the mmap's host address directly (how CI runs the GPU paths).
    host_is_device: bool = False
    uuid: str = ""  # "GPU-8f3c...", "" where there is no CUDA device
    driver_version: str = ""  # "580.159.04" (the kernel module's), else the CUDA driver API's
    errors: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        return asdict(self)


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """None -> the current CUDA device, or the CPU when there is none. A device this machine cannot
    use (a name torch does not know, CUDA where there is none, an index past the last GPU) raises
    ValueError saying which and what there is."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{device!r} is not a device: expected cpu, cuda or cuda:N ({exc})") from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise ValueError(f"device {str(dev)!r}: there is one CPU device, 'cpu'")
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device {str(dev)!r}: a table is served on cpu or cuda[:N], not on {dev.type}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r}: no CUDA device here (torch.cuda.is_available() is False)")
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` made the current CUDA device for a block (nothing on the CPU): torch and the
    driver record events, make streams, capture graphs and register memory on the current device,
    and work for cuda:1 must not land on cuda:0."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def driver_version() -> str:
    """The NVIDIA kernel module's version from /proc/driver/nvidia/version, else the CUDA driver
    API version ("CUDA 13.0"), else ""."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", f.readline())
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if int(err) == 0:
            return f"CUDA {version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001 - a name for a cache key; never a reason to fail
        pass
    return ""


def _device_uuid(index: int) -> str:
    try:
        return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    except Exception:  # noqa: BLE001 - older torch without .uuid: the key falls back to the name
        return ""


def read_capabilities(device: str | int | torch.device | None = None) -> DeviceCapabilities:
    """Ask the driver about ``device``; never raises: errors are recorded in ``.errors``, and a
    device this machine cannot use (see resolve_device) is reported as no CUDA device, with why."""
    try:
        dev = resolve_device(device)
    except ValueError as exc:
        return DeviceCapabilities(cuda=False, device=str(device), errors=(str(exc),))
    if dev.type != "cuda":
        return DeviceCapabilities(
            cuda=False, device=str(dev), name="cpu", host_is_device=triton_interpreter()
        )
    index = dev.index  # resolve_device names a CUDA device's index
    errors: list[str] = []
    values: dict[str, bool] = {}
    try:
        from cuda.bindings import driver, runtime
    except ImportError as exc:  # pragma: no cover - cuda-python is a dependency
        return DeviceCapabilities(cuda=True, device=f"cuda:{index}", errors=(f"cuda-python missing: {exc}",))
    torch.cuda.init()
    runtime_attrs = {
        "pageable_memory_access": "cudaDevAttrPageableMemoryAccess",
        "pageable_memory_access_uses_host_page_tables": "cudaDevAttrPageableMemoryAccessUsesHostPageTables",
        "host_register_supported": "cudaDevAttrHostRegisterSupported",
        "can_use_host_pointer_for_registered_mem": "cudaDevAttrCanUseHostPointerForRegisteredMem",
        "integrated": "cudaDevAttrIntegrated",
    }
    for key, attr in runtime_attrs.items():
        enum = getattr(runtime.cudaDeviceAttr, attr, None)
        if enum is None:
            errors.append(f"{attr}: not in this cuda-bindings")
            continue
        err, value = runtime.cudaDeviceGetAttribute(enum, index)
        if int(err) != 0:
            errors.append(f"{attr}: {err}")
        else:
            values[key] = bool(value)
    # ReadOnlyHostRegisterSupported through the driver API (cuda-bindings 13's runtime enum lacks it).
    err, cu_dev = driver.cuDeviceGet(index)
    enum = getattr(driver.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED", None)
    if int(err) != 0 or enum is None:
        errors.append(
            f"CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: {err if int(err) else 'missing'}"
        )
    else:
        err, value = driver.cuDeviceGetAttribute(enum, cu_dev)
        if int(err) != 0:
            errors.append(f"CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: {err}")
        else:
            values["read_only_host_register_supported"] = bool(value)
    return DeviceCapabilities(
        cuda=True,
        device=f"cuda:{index}",
        name=torch.cuda.get_device_name(index),
        uuid=_device_uuid(index),
        driver_version=driver_version(),
        errors=tuple(errors),
        **values,
    )
