"""The probe: which access mode a device and a table allow, and why each other mode was rejected.

Each mode declares what it needs (the Liger-Kernel ``reason_if_unsatisfied`` idea): a gate returns
None when satisfied, else a sentence. ``auto`` takes the first of ats, registered, cpu whose gate
passes (on an HMM device: registered, ats, cpu; see ``auto_order``); ``device`` is explicit only.
This module is the policy alone: ``ple_um.opening`` runs it, makes the first read of a guarded mode
in a child process (``ple_um.access.first_read``) and self-tests the mode it builds.

The ``ats`` mode is the direct read: the kernel dereferences the mapping's host addresses. A
device offers it in one of two ways, which ``direct_read`` names: hardware coherent (ATS: the GPU
walks the CPU's page tables) or HMM (the driver mirrors the CPU's page tables into the GPU's in
software, serving each GPU fault on a host page).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from ple_um import envs
from ple_um.access import memory
from ple_um.access.capabilities import DeviceCapabilities
from ple_um.errors import ModeUnavailableError
from ple_um.units import format_bytes

logger = logging.getLogger(__name__)

AUTO_ORDER = ("ats", "registered", "cpu")
# On HMM a GPU read of a page not yet mapped for it is a fault the driver serves in software, and a
# file-backed page is never migrated: it is mapped for the GPU where it lies. Registration maps
# every page at open, so registered comes first while the table fits the pin budget; the direct
# read serves what does not fit, in place of the cpu mode (README, "Access modes").
HMM_ORDER = ("registered", "ats", "cpu")
ATS_DIRECT_READ = "hardware coherent (ATS)"
HMM_DIRECT_READ = "HMM"
INTERPRETER_DIRECT_READ = "Triton interpreter: the host is the device"
ALL_MODES = tuple(m for m in envs.MODES if m != "auto")  # the modes a table can be served in


@dataclass
class ProbeReport:
    """The mode chosen, why every other mode was not, and the capabilities read."""

    mode: str
    reasons: dict[str, str] = field(default_factory=dict)
    capabilities: dict = field(default_factory=dict)
    pin_budget: int | None = None
    # How this device reads host addresses directly (ATS_DIRECT_READ, HMM_DIRECT_READ, ...), or None.
    direct_read: str | None = None
    # The first-read verdicts that concern the chosen mode: ple_um.access.first_read.FirstReadVerdict
    # (an open or a probe of a table sets one; a probe without a table lists the cached ones).
    first_read: list = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"mode: {self.mode}"]
        lines += [f"  not {m}: {why}" for m, why in self.reasons.items()]
        lines.append(f"direct read: {self.direct_read or 'none (the GPU cannot dereference host addresses)'}")
        lines += [verdict.describe() for verdict in self.first_read]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return asdict(self)  # the first-read verdicts as their dicts too


def _unknown(mode: str) -> ValueError:
    return ValueError(f"unknown access mode {mode!r}; expected one of auto, {', '.join(ALL_MODES)}")


def pin_budget() -> int:
    """Most bytes the registered mode may pin: PLE_UM_PIN_BUDGET, else a fraction of MemAvailable."""
    explicit = envs.PLE_UM_PIN_BUDGET
    if explicit is not None:
        return int(explicit)
    return int(memory.mem_available() * envs.PLE_UM_PIN_FRACTION)


def direct_read(caps: DeviceCapabilities) -> str | None:
    """How ``caps``' device can dereference a host address (an mmap's), or None when it cannot."""
    if caps.pageable_memory_access_uses_host_page_tables:
        return ATS_DIRECT_READ
    if caps.pageable_memory_access:
        return HMM_DIRECT_READ
    if caps.host_is_device:
        return INTERPRETER_DIRECT_READ
    return None


def auto_order(caps: DeviceCapabilities) -> tuple[str, ...]:
    """The modes ``auto`` tries, in order, on ``caps``' device."""
    return HMM_ORDER if direct_read(caps) == HMM_DIRECT_READ else AUTO_ORDER


def reason_if_unsatisfied(
    mode: str, caps: DeviceCapabilities, table_bytes: int | None, budget: int | None
) -> str | None:
    """None when ``mode`` can serve a table of ``table_bytes`` on this device, else why not."""
    if mode not in ALL_MODES:
        raise _unknown(mode)
    # The cpu mode reads on the host; where the host is the device (the interpreter) so do the
    # others, but for registration, which needs CUDA.
    if mode == "cpu" or caps.host_is_device and mode != "registered":
        return None
    if not caps.cuda:
        return "no CUDA device"
    if mode == "ats" and direct_read(caps) is None:
        return (
            "the device reports neither PageableMemoryAccessUsesHostPageTables (ATS) nor "
            "PageableMemoryAccess (HMM): it cannot dereference an mmap's host address"
        )
    if mode != "registered":
        return None
    if not caps.host_register_supported:
        return "the device does not support cudaHostRegister (HostRegisterSupported = 0)"
    if not caps.read_only_host_register_supported:
        return (
            "the device does not support read-only host registration "
            "(ReadOnlyHostRegisterSupported = 0), which a PROT_READ file mapping needs"
        )
    if table_bytes is not None and budget is not None and table_bytes > budget:
        return (
            f"the table ({format_bytes(table_bytes)}) is larger than the pin budget "
            f"({format_bytes(budget)}); "
            "raise PLE_UM_PIN_BUDGET or PLE_UM_PIN_FRACTION to allow it"
        )
    return None


def decide(
    caps: DeviceCapabilities,
    *,
    mode: str = "auto",
    table_bytes: int | None = None,
    budget: int | None = None,
    exclude: dict[str, str] | None = None,
) -> ProbeReport:
    """Pick a mode for ``caps``. ``mode`` other than auto is forced: it must pass its gate or this
    raises ModeUnavailableError. ``exclude`` maps modes already rejected (a failed self-test) to why."""
    if mode != "auto" and mode not in ALL_MODES:
        raise _unknown(mode)
    exclude = exclude or {}
    reasons: dict[str, str] = {}
    for m in ALL_MODES:
        why = exclude.get(m) or reason_if_unsatisfied(m, caps, table_bytes, budget)
        if why is not None:
            reasons[m] = why
    if mode == "auto":
        chosen = next((m for m in auto_order(caps) if m not in reasons), None)
        if chosen is None:
            raise ModeUnavailableError(
                "auto", "every mode was rejected: " + "; ".join(f"{m}: {why}" for m, why in reasons.items())
            )
    elif mode in reasons:
        raise ModeUnavailableError(mode, reasons[mode])
    else:
        chosen = mode
    for m in ALL_MODES:  # the modes that would have worked: why not them
        if m != chosen and m not in reasons:
            reasons[m] = comes_first(chosen, m, caps) if mode == "auto" else f"{chosen} was asked for"
    return ProbeReport(
        mode=chosen,
        reasons=reasons,
        capabilities=caps.as_dict(),
        pin_budget=budget,
        direct_read=direct_read(caps),
    )


def comes_first(chosen: str, other: str, caps: DeviceCapabilities) -> str:
    """Why ``auto`` did not take ``other``, which would have worked: ``chosen`` is tried before it, or
    ``other`` is ``device``, which ``auto`` never takes."""
    if other == "device":
        return "explicit only: it copies the whole table into GPU memory"
    if (chosen, other) == ("registered", "ats") and direct_read(caps) == HMM_DIRECT_READ:
        return (
            "registered comes first on HMM: registration maps every page for the GPU at open, "
            "while a direct read faults each page in through the driver on first touch "
            "(ats serves a table over the pin budget)"
        )
    return f"{chosen} comes first"


def requested_mode(mode: str) -> str:
    """The mode to use: an explicit argument wins; with "auto" the PLE_UM_MODE knob may force one.
    The name in any case, as PLE_UM_MODE and the bench's ``--modes`` take it."""
    named = mode.lower()
    if named not in ("auto", *ALL_MODES):
        raise _unknown(mode)
    return envs.PLE_UM_MODE if named == "auto" else named
