"""RegisteredMapping: cudaHostRegister(Mapped | ReadOnly | Portable) over every mapped region.

On a discrete GPU without ATS (an H200 in an x86 host, say) registration pins the range and gives the GPU a
device pointer to it: the kernel reads rows over PCIe, no copy, no GPU memory. A ``PROT_READ``
mapping needs the ReadOnly flag (with the default flags the driver refuses a read-only range with
cudaErrorInvalidValue). On ATS systems the same call only populates the pages (it does not pin),
which the ats mode may use. The object owns the registrations: a failure part-way releases the
earlier ones, and ``close()`` unregisters in reverse order once its caller has waited for every
lookup that reads the pages (``table.release_mode``). The calls
are the machine's (``ple_um.access.machine.registration()``: CUDA's, or an injected machine's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from ple_um.access.machine import HostRegistration, RegistrationError, registration
from ple_um.mapping import MappedShards

logger = logging.getLogger(__name__)


class RegisteredMapping:
    """The CUDA registrations of a MappedShards' regions and the device base of each shard.

    ``calls``: the registration calls (default: the machine's, read when it is built)."""

    def __init__(
        self,
        mapping: MappedShards,
        device: torch.device,
        *,
        calls: HostRegistration | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        calls = calls or registration()
        self.mapping = mapping
        self.device = device
        self._unregister = calls.unregister
        self._registered: list[int] = []
        self.device_addrs: list[int] = []
        self.registered_bytes = 0
        self._closed = False
        t0 = time.perf_counter()
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                for region in mapping.regions:
                    try:
                        calls.register(region.addr, region.length)
                    except RegistrationError as exc:
                        raise RegistrationError(f"{exc} for {region.path}") from None
                    self._registered.append(region.addr)
                    self.registered_bytes += region.length
                    self.device_addrs.append(calls.device_pointer(region.addr))
                    if progress is not None:
                        progress(region.length)
        except BaseException:
            self.close()
            raise
        self.seconds = time.perf_counter() - t0

    def device_bases(self) -> list[int]:
        """Per shard: the device address of its local row 0 (0 for shards with no owned rows)."""
        bases = []
        for index in range(self.mapping.layout.parts):
            owned = self.mapping.owned.get(index)
            if owned is None:
                bases.append(0)
                continue
            region = self.mapping.regions[owned.region]
            host_base = self.mapping.shard_base(index)
            bases.append(self.device_addrs[owned.region] + (host_base - region.addr))
        return bases

    def close(self) -> None:
        """Unregister; idempotent. The caller has waited for every kernel that reads the pages
        (``table.release_mode``)."""
        if self._closed:
            return
        self._closed = True
        for addr in reversed(self._registered):
            self._unregister(addr)
        self._registered.clear()
